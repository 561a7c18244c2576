"""pass^k as τ-bench defines it, and the eval report built on it."""

from __future__ import annotations

import pytest

from wakeful.server.evals.passk import pass_hat_k
from wakeful.server.evals.runner import Trial, report, table
from wakeful.server.evals.scenario import check


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (4, 4, 4, 1.0),        # every trial passed: any k of them all pass
    (4, 2, 1, 0.5),        # pass^1 is the pass rate
    (4, 2, 2, 1 / 6),      # C(2,2)/C(4,2): one pair of the six is all-passing
    (5, 3, 2, 3 / 10),     # C(3,2)/C(5,2)
    (8, 7, 4, 35 / 70),    # C(7,4)/C(8,4)
    (3, 1, 2, 0.0),        # fewer passes than k: no draw of k all passes
])
def test_pass_hat_k_is_c_choose_k_over_n_choose_k(n: int, c: int, k: int, expected: float) -> None:
    assert pass_hat_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize(("n", "c", "k"), [(2, 1, 3), (2, 3, 1), (2, 1, 0), (2, -1, 1)])
def test_pass_hat_k_refuses_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_hat_k(n, c, k)


def _trial(scenario: str, number: int, status: str) -> Trial:
    return Trial(scenario=scenario, trial=number, status=status, checks=(check("x", status == "passed", None),),
                 seconds=1.0)


def test_the_overall_figure_is_the_mean_over_scenarios_and_pending_ones_count_for_neither_side() -> None:
    results = [_trial("a", 1, "passed"), _trial("a", 2, "passed"), _trial("a", 3, "failed"),
               _trial("b", 1, "passed"), _trial("b", 2, "passed"), _trial("b", 3, "passed"),
               Trial(scenario="later", trial=1, status="pending", checks=(), seconds=0.0, needs="helper B")]
    document = report(results, k=2, model="scripted")
    assert document["scenarios"]["a"]["pass^k"] == pytest.approx(1 / 3)  # C(2,2)/C(3,2)
    assert document["scenarios"]["b"]["pass^k"] == 1.0
    assert document["pass^k"] == pytest.approx((1 / 3 + 1.0) / 2)
    assert document["failed"] == 1 and document["pending"] == ["later"]
    assert document["scenarios"]["later"] == {"status": "pending", "trials": 1, "passed": 0, "pass^k": None,
                                              "needs": "helper B"}
    lines = table(document).splitlines()
    assert lines[0].split() == ["scenario", "status", "passed", "pass^2"]
    assert lines[1].split() == ["a", "failed", "2/3", "0.333"]
    assert "needs: helper B" in lines[3]
    assert lines[-1].startswith("overall pass^2: 0.667")
