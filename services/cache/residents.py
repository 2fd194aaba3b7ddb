"""Host residents in ascending (host score, session id) order, without scoring them all.

A pressure eviction that finds the host short of room (``CachePolicy.evict``) walks the
host residents in ascending (host score, session id) order and stops at the first whose
score is not below the candidate's, or as soon as it has room: in the scale benchmark it
reads 2 or 3 of them, out of about a thousand. Listing and scoring every resident for it
(``CachePolicy.host_residents``) cost 20x the manager's throughput at 2,000 sessions.
``HostResidentIndex.ascending`` gives the same residents in the same order, with the same
scores, lazily, scoring only the residents that could come next.

**Why scores cannot simply be kept sorted.** ``host_score = p * saved(h) / (GB(h) *
max(D, min_distance_s))``: ``p`` and ``h`` change only with the session, but the distance
``D`` moves with the time (a tool's mean residual life at its age, which is not monotone),
with every tool completion (the learned latencies) and with the measured delays. So the
order of one eviction says nothing exact about the next one's.

**What is kept.** Residents are grouped by what their distance is a function of: *flat*
(idle, or no tool: ``D = q``), *pending* (phase, tool; verdict pending: ``D`` falls as
the wait since the proposal grows) and *running* (phase, tool; started: ``D`` is that
tool's mean residual life at its age). A group keeps its members sorted by a key that
does not change with time: the proposal time (pending), the start time (running), the
time-free part of the score, ``host_value = p * saved / GB`` (flat), with each member's
``host_value`` in a list aligned with the keys.

**The search** (best first, branch and bound). A node is a run of consecutive members of
a group; its bound is a lower bound of every member's score: the least ``host_value`` of
the run over an upper bound of their distance over the run's
interval of waits (``CachePolicy.next_reference_bound_s``, from the latency model's
``mean_residual_life_bound``, close to the true maximum however wide the interval).
The frontier holds nodes by bound; the smallest is split (``_FANOUT`` parts) or,
when small (``_LEAF`` members at most), its members are scored exactly, by
``CachePolicy.host_score`` on the same view as the listing makes, into a heap of scored
residents. The smallest scored resident is handed out once its score is strictly below
every bound left: nothing unscored can come before it, ties included (an equal score with
a smaller session id would need a bound equal to it). ``below(cutoff)`` stops as soon as
every bound left is at least the cutoff (the eviction rule reads no resident whose score is
not below the candidate's). Bounds carry a relative margin of 1e-6 for rounding. So the
order and every score are those of ``CachePolicy.host_residents`` over the same residents;
bounds only decide how much is scored. ``tests/unit/services/cache/test_residents.py``
checks it against that listing on random residents and random manager workloads.

**A snapshot per eviction run.** The policy reads the residents as they were when it
first asked for them, and may iterate again from the start for the next candidate (the
residents it displaced are marked). ``ascending`` therefore freezes the index: changes
(a candidate swapped out in the same run becomes a resident) are queued until ``thaw``.
The sequence it returns remembers what it has handed out, so a second iteration replays
it and then continues the search.

Pure: ``now`` and the delays are parameters.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

from schemas.events import SessionId
from services.cache.policy import CachePolicy, Delays, HostResident
from services.cache.view import Phase, SessionView

__all__ = ["HostResidentIndex", "ResidentsInOrder"]

_FANOUT = 4  # parts a node is split into
_LEAF = 8  # a node of at most this many members is scored member by member
# How long (manager seconds) a running node's bound of its tool's residual life is kept. A wider
# window bounds longer waits, so its bounds are looser and searches split more: at 10,000 sessions
# (bench.cache_manager_scale, ranked pins) 0.5 s pushed twice the nodes, 2 ms as many as bounds
# made afresh, 88% of them kept from an earlier search.
_REUSE_S = 0.002


class _Kind(Enum):
    FLAT = 0  # D = q
    PENDING = 1  # verdict pending: keyed by the proposal time
    RUNNING = 2  # tool running: keyed by its start time


_GroupKey = tuple[_Kind, str, Phase]


@dataclass(slots=True)
class _Group:
    kind: _Kind
    tool: str
    phase: Phase
    keys: list[tuple[float, SessionId]] = field(default_factory=list)  # sorted
    values: list[float] = field(default_factory=list)  # the host value of each key's member, aligned
    least: float | None = None  # min(values) while known: every search bounds the whole group first
    # Running groups: (lo, hi) -> (tool samples, from, until, bound of the residual life of
    # members lo .. hi - 1 at any time from .. until), kept while the members are the same.
    residuals: dict[tuple[int, int], tuple[int, float, float, float]] = field(default_factory=dict)
    leasts: dict[tuple[int, int], float] = field(default_factory=dict)  # (lo, hi) -> min(values[lo:hi])

    def least_value(self) -> float:
        if self.least is None:
            self.least = min(self.values)
        return self.least

    def least_of(self, lo: int, hi: int) -> float:
        """min(values[lo:hi]), kept while the members are the same (every search splits the
        same nodes); the whole group's is ``least``, kept across changes where it can be."""
        if lo == 0 and hi == len(self.keys):
            return self.least_value()
        least = self.leasts.get((lo, hi))
        if least is None:
            least = self.leasts[(lo, hi)] = min(self.values[lo:hi])
        return least

    def changed(self) -> None:
        """A member came or went: what was kept of runs of members no longer holds."""
        self.residuals.clear()
        self.leasts.clear()


@dataclass(slots=True)
class _Entry:
    source: SessionView  # the view it was made from (unchanged view and blocks: nothing to do)
    view: SessionView  # as a host resident: no GPU blocks, its host blocks
    group: _GroupKey
    key: tuple[float, SessionId]


class HostResidentIndex:
    """The host residents a manager keeps, grouped and sorted for ``ascending`` (module docstring)."""

    def __init__(self, policy: CachePolicy) -> None:
        self.policy = policy
        self._entries: dict[SessionId, _Entry] = {}
        self._groups: dict[_GroupKey, _Group] = {}
        self._frozen = False
        self._pending: dict[SessionId, tuple[SessionView, int] | None] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def put(self, view: SessionView, host_blocks: int) -> None:
        """``view``'s session is a host resident with ``host_blocks`` on the host (``view``: the
        session's view; its phase neither LLM nor FINISHED, ``host_blocks > 0``)."""
        sid = view.session_id
        if self._frozen:
            self._pending[sid] = (view, host_blocks)
            return
        entry = self._entries.get(sid)
        if entry is not None:
            if entry.source is view and entry.view.host_blocks == host_blocks:
                return
            self._remove(sid, entry)
        resident = SessionView(
            sid, view.phase, view.since, view.tool, view.tool_started_at, view.context_tokens, 0, host_blocks,
            view.turns, view.attained_service_s,
        )  # fmt: skip
        value = self.policy.host_value(resident, host_blocks)
        if view.phase is Phase.IDLE or view.tool is None:
            group_key: _GroupKey = (_Kind.FLAT, "", view.phase)
            key = (value, sid)
        elif view.tool_started_at is None:
            group_key, key = (_Kind.PENDING, view.tool, view.phase), (view.since, sid)
        else:
            group_key, key = (_Kind.RUNNING, view.tool, view.phase), (view.tool_started_at, sid)
        group = self._groups.get(group_key)
        if group is None:
            group = self._groups[group_key] = _Group(*group_key)
        i = bisect.bisect_left(group.keys, key)
        group.keys.insert(i, key)
        group.values.insert(i, value)
        group.changed()
        if group.least is not None and value < group.least:
            group.least = value
        self._entries[sid] = _Entry(view, resident, group_key, key)

    def discard(self, session_id: SessionId) -> None:
        """The session is no host resident (any more)."""
        if self._frozen:
            if session_id in self._entries or session_id in self._pending:
                self._pending[session_id] = None
            return
        entry = self._entries.get(session_id)
        if entry is not None:
            self._remove(session_id, entry)

    def _remove(self, sid: SessionId, entry: _Entry) -> None:
        del self._entries[sid]
        group = self._groups[entry.group]
        keys = group.keys
        i = bisect.bisect_left(keys, entry.key)
        del keys[i]
        group.changed()
        if group.values.pop(i) == group.least:
            group.least = None
        if not keys:
            del self._groups[entry.group]

    def ascending(self, now: float, delays: Delays) -> ResidentsInOrder:
        """The residents in ascending (host score, session id) order at ``now``, as
        ``CachePolicy.host_residents`` lists them; the index is frozen until ``thaw``."""
        self._frozen = True
        return ResidentsInOrder(self, now, delays)

    def thaw(self) -> None:
        """Apply the changes queued since ``ascending`` (the sequence it returned is spent)."""
        self._frozen = False
        pending, self._pending = self._pending, {}
        for sid, change in pending.items():
            if change is None:
                self.discard(sid)
            else:
                self.put(*change)


class ResidentsInOrder:
    """``RankedResidents`` of a frozen ``HostResidentIndex``, searched as far as asked (module
    docstring); what was found is kept, so every call starts from the first."""

    __slots__ = ("_delays", "_entries", "_found", "_frontier", "_now", "_policy", "_scored", "_tiebreak")

    def __init__(self, index: HostResidentIndex, now: float, delays: Delays) -> None:
        self._policy = index.policy
        self._entries = index._entries
        self._now = now
        self._delays = delays
        self._found: list[HostResident] = []
        self._frontier: list[tuple[float, int, _Group, int, int]] = []  # (bound, tiebreak, group, lo, hi)
        self._scored: list[tuple[float, SessionId, SessionView]] = []  # (score, id, view): ids are unique
        self._tiebreak = 0
        for group in index._groups.values():
            self._push(group, 0, len(group.keys))

    def __iter__(self) -> Iterator[HostResident]:
        return iter(self.below(math.inf))

    def below(self, host_score: float) -> Iterator[HostResident]:
        found = self._found
        i = 0
        while True:
            if i == len(found) and self._next(host_score) is None:
                return
            resident = found[i]
            if resident.host_score >= host_score:
                return
            yield resident
            i += 1

    def _next(self, cutoff: float) -> HostResident | None:
        """Find the next resident in order if its score is below ``cutoff`` (else None, the search
        left where it was)."""
        frontier, scored = self._frontier, self._scored
        while True:
            bound = frontier[0][0] if frontier else math.inf
            if scored and scored[0][0] < bound:
                if scored[0][0] >= cutoff:
                    return None
                score, sid, view = heapq.heappop(scored)
                resident = HostResident(score, sid, view)
                self._found.append(resident)
                return resident
            if bound >= cutoff:
                return None  # every resident left scores at least ``bound``
            _, _, group, lo, hi = heapq.heappop(frontier)
            if hi - lo <= _LEAF:
                now, delays, host_score, entries = self._now, self._delays, self._policy.host_score, self._entries
                for _, sid in group.keys[lo:hi]:
                    view = entries[sid].view
                    heapq.heappush(scored, (host_score(view, view.host_blocks, now, delays), sid, view))
            else:
                step = -(-(hi - lo) // _FANOUT)
                for a in range(lo, hi, step):
                    self._push(group, a, min(hi, a + step))

    def _push(self, group: _Group, lo: int, hi: int) -> None:
        """Members ``lo .. hi - 1`` of ``group`` into the frontier, with a lower bound of their scores."""
        policy, delays, keys = self._policy, self._delays, group.keys
        if group.kind is _Kind.FLAT:
            bound = policy.host_score_lower_bound(keys[lo][0], delays.queue_s)
        else:
            if group.kind is _Kind.RUNNING:
                distance = policy.distance_from_remaining_s(group.phase, self._residual_bound(group, lo, hi), delays)
            else:
                # Keys ascend, so the wait is shortest at the last member and longest at the first.
                distance = policy.next_reference_bound_s(
                    group.phase, group.tool, False, self._now - keys[hi - 1][0], self._now - keys[lo][0], delays
                )
            bound = policy.host_score_lower_bound(group.least_of(lo, hi), distance)
        self._tiebreak += 1
        heapq.heappush(self._frontier, (bound, self._tiebreak, group, lo, hi))

    def _residual_bound(self, group: _Group, lo: int, hi: int) -> float:
        """An upper bound of the residual life of running members ``lo .. hi - 1``' tool: the last
        search's when it holds at this search's time (the same members and tool samples; it bounds
        the waits of a window of ``_REUSE_S`` from when it was made), else one for a new window.
        A search per pressure eviction bounds the same nodes again and again; most of its cost was
        the latency model's bound (``ToolLatencyModel.mean_residual_life_bound``)."""
        latency, now = self._policy.latency, self._now
        samples = latency.num_samples(group.tool)
        kept = group.residuals.get((lo, hi))
        if kept is not None and kept[0] == samples and kept[1] <= now <= kept[2]:
            return kept[3]
        until = now + _REUSE_S
        # Keys ascend: over the window, the wait is shortest at the last member now, longest at
        # the first at its end.
        bound = latency.mean_residual_life_bound(group.tool, now - group.keys[hi - 1][0], until - group.keys[lo][0])
        group.residuals[(lo, hi)] = (samples, now, until, bound)
        return bound
