"""The bytes held for request bodies: per client and in total, never over either cap, all given back."""

from __future__ import annotations

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wakeful.proxy.contract import ProxyRefusal, RefusalCode
from wakeful.proxy.limits import BodyBudget, Held, RowBudget
from wakeful.proxy.wire import refusal_response


def test_a_reservation_over_the_clients_cap_is_refused_while_another_client_still_fits() -> None:
    budget = BodyBudget(total=1000, per_client=600)
    assert budget.reserve("user:a", 500)
    assert not budget.reserve("user:a", 200)
    assert budget.reserve("user:b", 400)
    assert not budget.reserve("user:c", 200)  # the total
    budget.release("user:a", 500)
    assert budget.reserve("user:c", 200) and budget.total == 600


def test_a_held_body_that_outgrows_the_caps_is_refused_proxy_busy_and_gives_everything_back() -> None:
    budget = BodyBudget(total=100, per_client=100)
    held = Held(budget, "connector")
    held.take(60)
    with pytest.raises(ProxyRefusal) as err:
        held.take(41)
    assert err.value.code == RefusalCode.PROXY_BUSY
    held.release()
    assert budget.total == 0 and budget.held_by("connector") == 0
    Held(budget, "nobody").release()  # a request refused before its body held nothing


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 400), st.booleans()), max_size=60))
@settings(max_examples=300, deadline=None)
def test_no_sequence_of_reservations_and_releases_passes_a_cap(steps: list[tuple[str, int, bool]]) -> None:
    budget = BodyBudget(total=1000, per_client=600)
    holding: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    for client, size, release in steps:
        if release and holding[client]:
            budget.release(client, holding[client].pop())
        elif budget.reserve(client, size):
            holding[client].append(size)
        assert budget.total == sum(map(sum, holding.values())) <= 1000
        assert all(budget.held_by(c) == sum(sizes) <= 600 for c, sizes in holding.items())


@pytest.mark.parametrize(("code", "status"), [(RefusalCode.REQUEST_TIMEOUT, 408),
                                              (RefusalCode.TOO_MANY_CONNECTIONS, 503)])
def test_a_refusal_without_a_request_is_a_whole_closing_http_response(code: RefusalCode, status: int) -> None:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(refusal_response(code, "why"))
    response, data, end = conn.next_event(), conn.next_event(), conn.next_event()
    assert isinstance(response, h11.Response) and response.status_code == status
    assert dict(response.headers)[b"x-wakeful-refusal"] == code.encode()
    assert dict(response.headers)[b"connection"] == b"close"
    assert isinstance(data, h11.Data) and b'"code":"' + code.encode() in data.data
    assert isinstance(end, h11.EndOfMessage)


def test_a_row_budget_allows_its_burst_then_one_row_per_interval_and_refills_no_further_than_the_burst() -> None:
    budget = RowBudget(burst=3, every=10.0)
    assert [budget.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert (budget.take(5.0), budget.take(10.0), budget.take(10.0)) == (False, True, False)
    assert [budget.take(1000.0) for _ in range(4)] == [True, True, True, False]  # a long quiet refills the burst
    with pytest.raises(ValueError):
        RowBudget(burst=1, every=0.0)
