"""pass^k as τ-bench defines it: the chance that k trials drawn from a scenario's n all pass.

Over n trials of which c passed, an unbiased estimate is C(c, k) / C(n, k); the overall figure is its mean over the
scenarios. pass^1 is the plain pass rate; pass^k falls as k grows unless the agent passes reliably.
"""

from __future__ import annotations

from math import comb

__all__ = ["pass_hat_k"]


def pass_hat_k(n: int, c: int, k: int) -> float:
    """C(c, k) / C(n, k); needs 1 <= k <= n and 0 <= c <= n."""
    if not 1 <= k <= n:
        raise ValueError(f"pass^k needs 1 <= k <= n trials, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"passing trials must be between 0 and n={n}, got {c}")
    return comb(c, k) / comb(n, k)
