"""How an answer to a connector request becomes an outcome: the egress proxy's own refusals (nothing was dialled)
are told apart from the remote's."""

from __future__ import annotations

import httpx
import pytest

from wakeful.proxy.contract import REFUSAL_HEADER
from wakeful.server.egress.dispatch import classify
from wakeful.server.store.tables import Outcome

REQUEST = httpx.Request("POST", "https://merchant.test/v1/cancel")


@pytest.mark.parametrize(("status", "code"), [(403, "not_admitted"), (403, "content_mismatch"),
                                              (413, "request_too_large"), (502, "decider_unavailable")])
def test_a_refusal_by_the_egress_proxy_is_blocked_and_says_so(status: int, code: str) -> None:
    answer = httpx.Response(status, headers={REFUSAL_HEADER: code}, json={"error": {"code": code, "message": "no"}},
                            request=REQUEST)
    result = classify(answer, None)
    assert result.outcome is Outcome.BLOCKED
    assert result.detail == f"refused by the egress proxy ({code}): no"


def test_a_413_from_the_remote_itself_is_the_remotes_refusal() -> None:
    result = classify(httpx.Response(413, json={"error": "too big"}, request=REQUEST), None)
    assert result.outcome is Outcome.BLOCKED and result.detail.startswith("refused by the remote: HTTP 413")


@pytest.mark.parametrize("code", ["upstream_failed", "upstream_timeout"])
def test_a_failure_after_the_proxy_dialled_stays_unknown(code: str) -> None:
    answer = httpx.Response(502 if code == "upstream_failed" else 504, headers={REFUSAL_HEADER: code},
                            request=REQUEST)
    assert classify(answer, None).outcome is Outcome.UNKNOWN
