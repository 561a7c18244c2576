"""Where a tool computer goes among several hosts: the pure rules of `vm.placement`."""

from __future__ import annotations

import pytest

from wakeful.vm.errors import HostsBusy, NoHostAvailable
from wakeful.vm.placement import HostLoad, HostMark, place


def load(name: str, *, capacity: int = 4096, allocated: int = 0, free: int | None = None, arriving: int = 0,
         max_arriving: int = 2, mark: HostMark = HostMark.UP, reachable: bool = True) -> HostLoad:
    return HostLoad(name=name, capacity_mib=capacity, allocated_mib=allocated, free_mib=free, arriving=arriving,
                    max_arriving=max_arriving, mark=mark, reachable=reachable)


def test_the_host_with_the_most_free_memory_takes_a_new_computer() -> None:
    assert place([load("a", allocated=3000), load("b", allocated=1000)], 512, home=None) == "b"


def test_a_computer_goes_back_to_its_own_host_while_that_host_has_room() -> None:
    assert place([load("a", allocated=3000), load("b")], 512, home="a") == "a"


def test_a_full_home_sends_the_computer_to_another_host() -> None:
    assert place([load("a", allocated=3800), load("b")], 512, home="a") == "b"


@pytest.mark.parametrize("mark", [HostMark.FULL, HostMark.GONE])
def test_a_home_marked_full_or_gone_sends_the_computer_elsewhere(mark: HostMark) -> None:
    assert place([load("a", mark=mark), load("b", allocated=3000)], 512, home="a") == "b"


def test_an_unreachable_home_sends_the_computer_elsewhere() -> None:
    assert place([load("a", reachable=False), load("b", allocated=3000)], 512, home="a") == "b"


def test_the_hosts_own_free_memory_bounds_its_capacity() -> None:
    assert place([load("a", free=300), load("b", allocated=2000)], 512, home=None) == "b"


def test_a_host_at_its_restore_cap_is_skipped_for_one_with_less_memory() -> None:
    assert place([load("a", arriving=2), load("b", allocated=3000)], 512, home="a") == "b"


def test_when_every_host_with_room_is_at_its_restore_cap_the_answer_is_busy_not_none() -> None:
    with pytest.raises(HostsBusy) as caught:
        place([load("a", arriving=2), load("b", arriving=1, max_arriving=1), load("c", allocated=4000)], 512,
              home=None)
    assert caught.value.code == "hosts_busy"


def test_no_host_with_room_is_refused_naming_each_host_and_why() -> None:
    with pytest.raises(NoHostAvailable) as caught:
        place([load("a", allocated=4000), load("b", mark=HostMark.FULL), load("c", reachable=False)], 512,
              home=None)
    assert caught.value.code == "no_host_available"
    assert "a: 96 MiB free" in caught.value.message
    assert "b: marked full" in caught.value.message
    assert "c: unreachable" in caught.value.message


def test_ties_go_to_the_first_host_by_name() -> None:
    assert place([load("b"), load("a")], 512, home=None) == "a"
