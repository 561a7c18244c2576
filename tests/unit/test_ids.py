"""Ids sort in the order one process issued them, even within one millisecond."""

from __future__ import annotations

import threading
import time

from hypothesis import given
from hypothesis import strategies as st

from wakeful.server.store.ids import _ALPHABET, _b32, new_id


def test_ids_issued_one_after_another_sort_in_issue_order() -> None:
    issued = [new_id("ob") for _ in range(20_000)]  # many share a millisecond
    assert len({i[3:13] for i in issued}) < len(issued)
    assert issued == sorted(issued) and len(set(issued)) == len(issued)


def test_ids_from_many_threads_never_collide() -> None:
    out: list[list[str]] = [[] for _ in range(8)]

    def issue(bucket: list[str]) -> None:
        bucket.extend(new_id("ev") for _ in range(5_000))

    threads = [threading.Thread(target=issue, args=(b,)) for b in out]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for b in out for i in b]
    assert len(set(every)) == len(every)
    assert all(b == sorted(b) for b in out)


@given(st.integers(min_value=1, max_value=30).flatmap(
    lambda width: st.tuples(st.just(width), st.integers(min_value=0, max_value=32 ** width - 1))))
def test_ids_spell_numbers_in_crockford_base32_most_significant_digit_first(case: tuple[int, int]) -> None:
    width, value = case
    assert sum(_ALPHABET.index(c) * 32 ** i for i, c in enumerate(reversed(_b32(value, width)))) == value
    assert len(_b32(value, width)) == width


def test_an_id_is_its_millisecond_then_its_random_part() -> None:
    before = time.time_ns() // 1_000_000
    ms_digits = new_id("ev")[3:13]
    assert sum(_ALPHABET.index(c) * 32 ** i for i, c in enumerate(reversed(ms_digits))) >= before
