"""The engine models' waiting queue: first come first served, or lowest priority first.

``WaitQueue`` keeps the calls that wait for the engine. A call appended without a priority is
served in arrival order, which is what the engine models did before priorities (vLLM's ``fcfs``
policy); with priorities (``services.scheduling``'s scale: lower is served first) the lowest goes
first, ties in arrival order (vLLM's ``priority`` policy). ``appendleft`` puts a preempted call
back: at the head under FCFS (vLLM's recompute preemption), at its own priority otherwise (vLLM's
priority scheduler re-queues a preempted request by its priority).

A heap instead of a deque: with priorities a call joins in the middle; without them every key is
equal and the heap's tie-break (a counter) keeps arrival order, so one structure serves both.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator

from schemas.events import SessionId

__all__ = ["WaitQueue"]


class WaitQueue:
    """Waiting calls by ``(priority, arrival)``; one entry per session (a session has one call)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, SessionId]] = []
        self._seq = 0  # arrival counter: the tie-break
        self._head = 0  # counts down: appendleft entries go before every earlier one
        self.priority: dict[SessionId, float] = {}  # the priority each session's call was given

    def append(self, sid: SessionId, priority: float | None = None) -> None:
        """A new call; ``None``: no priority (FCFS among such calls, which all rank as 0)."""
        if priority is not None:
            self.priority[sid] = priority
        else:
            self.priority.pop(sid, None)
        heapq.heappush(self._heap, (0.0 if priority is None else priority, self._seq, sid))
        self._seq += 1

    def appendleft(self, sid: SessionId) -> None:
        """A preempted call goes back: at its priority if it has one, else at the head."""
        priority = self.priority.get(sid)
        self._head -= 1
        heapq.heappush(self._heap, (-math.inf if priority is None else priority, self._head, sid))

    def popleft(self) -> SessionId:
        return heapq.heappop(self._heap)[2]

    def __getitem__(self, index: int) -> SessionId:
        if index != 0:
            raise IndexError("only the head of the waiting queue can be read")
        return self._heap[0][2]

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[SessionId]:
        """In serving order (a copy: the queue is not changed)."""
        return (sid for _, _, sid in sorted(self._heap))
