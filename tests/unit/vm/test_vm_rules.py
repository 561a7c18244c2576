"""The pure lifecycle rules: one transition table, idle, limits, ports."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from wakeful.vm.errors import IllegalTransition, LimitExceeded
from wakeful.vm.lifecycle_rules import (
    TRANSITIONS,
    Activity,
    Limits,
    Op,
    VmSize,
    VmState,
    check_limits,
    is_idle,
    next_state,
    pick_ports,
    reap_candidates,
)

NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)
IDLE = timedelta(minutes=10)


@pytest.mark.parametrize(("state", "op", "target"), [
    (VmState.PROVISIONED, Op.START, VmState.RUNNING),
    (VmState.RUNNING, Op.SUSPEND, VmState.SUSPENDED),
    (VmState.SUSPENDED, Op.RESTORE, VmState.RUNNING),
    (VmState.RUNNING, Op.STOP, VmState.PROVISIONED),
    (VmState.SUSPENDED, Op.STOP, VmState.PROVISIONED),
    (VmState.PROVISIONED, Op.DESTROY, VmState.DESTROYED),
    (VmState.RUNNING, Op.DESTROY, VmState.DESTROYED),
    (VmState.SUSPENDED, Op.DESTROY, VmState.DESTROYED),
])
def test_allowed_transitions_reach_their_target(state: VmState, op: Op, target: VmState) -> None:
    assert next_state(state, op) is target


def test_every_pair_outside_the_table_is_refused_with_a_stable_code() -> None:
    for op, (sources, _) in TRANSITIONS.items():
        for state in set(VmState) - sources:
            with pytest.raises(IllegalTransition) as caught:
                next_state(state, op, vm="wk-x")
            assert caught.value.code == "illegal_transition"
            assert str(op) in caught.value.message and caught.value.vm == "wk-x"


def test_nothing_leaves_destroyed() -> None:
    assert all(VmState.DESTROYED not in sources for sources, _ in TRANSITIONS.values())


def test_a_vm_with_something_in_flight_is_never_idle() -> None:
    busy = Activity(in_flight=1, last_ended=NOW - timedelta(days=3))
    assert not is_idle(busy, NOW, IDLE)


def test_idle_only_after_idle_after_has_fully_passed() -> None:
    ended = Activity(last_ended=NOW - IDLE)
    assert not is_idle(ended, NOW, IDLE)
    assert is_idle(ended, NOW + timedelta(seconds=1), IDLE)


def test_activity_end_records_time_and_never_goes_negative() -> None:
    a = Activity().begin().begin().end(NOW)
    assert a == Activity(in_flight=1, last_ended=NOW)
    assert Activity().end(NOW).in_flight == 0


def test_only_running_idle_vms_are_reaped() -> None:
    old = Activity(last_ended=NOW - timedelta(hours=1))
    vms = {
        "b-running-idle": (VmState.RUNNING, old),
        "a-running-idle": (VmState.RUNNING, old),
        "busy": (VmState.RUNNING, old.begin()),
        "recent": (VmState.RUNNING, Activity(last_ended=NOW - timedelta(minutes=1))),
        "suspended": (VmState.SUSPENDED, old),
        "provisioned": (VmState.PROVISIONED, old),
    }
    assert reap_candidates(vms, NOW, IDLE) == ["a-running-idle", "b-running-idle"]


def test_limits_name_every_value_over_the_ceiling() -> None:
    with pytest.raises(LimitExceeded) as caught:
        check_limits(VmSize(memory_mib=8192, vcpus=4, disk_gib=64), Limits())
    assert caught.value.code == "limit_exceeded"
    for word in ("RAM 8192 MiB", "4 vCPUs", "disk 64 GiB"):
        assert word in caught.value.message
    check_limits(VmSize(memory_mib=4096, vcpus=2, disk_gib=32), Limits())


def test_ports_skip_those_held_by_vms_and_those_in_use_on_the_host() -> None:
    busy = {20001}
    assert pick_ports(3, used={20000}, port_range=(20000, 20010), is_free=lambda p: p not in busy) == [
        20002, 20003, 20004]


def test_an_exhausted_port_range_is_a_limit() -> None:
    with pytest.raises(LimitExceeded, match="20000–20001"):
        pick_ports(3, used=set(), port_range=(20000, 20001), is_free=lambda p: True)
