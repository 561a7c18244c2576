"""Ids sort in the order one process issued them, even within one millisecond."""

from __future__ import annotations

import threading

from server.ids import new_id


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
