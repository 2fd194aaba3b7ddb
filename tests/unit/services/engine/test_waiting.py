"""The engine models' waiting queue (``services.engine.waiting.WaitQueue``): FCFS without
priorities, lowest first with them, and where a preempted call goes back."""

from __future__ import annotations

import pytest

from schemas.events import SessionId
from services.engine.waiting import WaitQueue

pytestmark = pytest.mark.unit

A, B, C, D = (SessionId(x) for x in "abcd")


def drain(queue: WaitQueue) -> list[SessionId]:
    return [queue.popleft() for _ in range(len(queue))]


def test_without_priorities_it_is_first_come_first_served_and_a_preempted_call_goes_first() -> None:
    queue = WaitQueue()
    for sid in (A, B, C):
        queue.append(sid)
    assert queue[0] == A and len(queue) == 3 and list(queue) == [A, B, C]
    queue.appendleft(D)
    queue.appendleft(C)  # the latest appendleft is the new head, as a deque's
    assert drain(queue) == [C, D, A, B, C]
    assert not queue


def test_with_priorities_the_lowest_goes_first_ties_in_arrival_order() -> None:
    queue = WaitQueue()
    queue.append(A, 30.0)
    queue.append(B, 10.0)
    queue.append(C, 30.0)
    queue.append(D, 20.0)
    assert list(queue) == [B, D, A, C]
    assert queue.popleft() == B
    queue.appendleft(B)  # preempted: back at its own priority, not at the head
    queue.append(SessionId("e"), 5.0)
    assert drain(queue) == [SessionId("e"), B, D, A, C]
    assert queue.priority[A] == 30.0  # kept while the call runs: the batch model preempts by it


def test_only_the_head_can_be_read() -> None:
    queue = WaitQueue()
    queue.append(A)
    with pytest.raises(IndexError, match="head"):
        queue[1]
