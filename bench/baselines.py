"""The baseline cache managers of the cache-policy benchmark (``bench/cache_policies.py``, whose
docstring describes each): ``vllm``, ``infercept``, ``continuum`` (and ``continuum-2s``),
``kvflow`` and the ``oracle``. Each is a ``SimManager`` of the engine models in
``services.engine`` (serial and continuous batching) and acts through the cache's verbs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from schemas.events import SessionId
from services.cache import Phase
from services.engine.serial import Sess, SimManager

__all__ = ["BASELINES", "Baseline", "Continuum", "InferCept", "KVFlow", "Oracle", "VLLM", "make_baseline"]

_MS = 1000.0


class Baseline(SimManager):
    """Eviction helpers the baselines share."""

    def _evict_by(self, key: Callable[[SessionId], float], requester: Sess, needed: int, now: float) -> bool:
        """Evict pinned sessions, largest key first (ties by id), until ``needed`` blocks are freed."""
        victims = sorted((s for s in self.sim.pinned() if s != requester.sid), key=lambda x: (-key(x), x))
        freed = 0
        for sid in victims:
            if freed >= needed:
                break
            freed += self.sim.gpu_blocks_of(sid)
            self.evict(sid, now)
        return freed > 0

    def evict(self, sid: SessionId, now: float) -> None:
        """Swap out if the host has room and swap-in is cheaper than recompute, else release to the LRU
        (a lazy discard: the engine evicts only the blocks it needs, the context's tail first)."""
        sim = self.sim
        blocks = sim.gpu_blocks_of(sid)
        if 0 < blocks <= sim.cache.num_free_host_blocks and sim.cost.recompute_vs_swap(blocks) == "swap":
            sim.swap_out(sid, now)
        else:
            sim.cache.release(sid)


class VLLM(Baseline):
    name = "vllm"

    def on_finish(self, s: Sess, now: float) -> None:
        pass


class InferCept(Baseline):
    name = "infercept"

    def on_gap(self, s: Sess, now: float) -> None:
        sim = self.sim
        c = sim.gpu_blocks_of(s.sid)
        if c == 0:
            return
        duration = s.next_ready_at - now  # the TRUE tool duration, as the paper assumes
        m = sim.cache.num_gpu_blocks - sim.cache.num_free_blocks + c
        preserve = duration * c
        discard = sim.cost.recompute_ms(c * sim.bs) / _MS * m
        swap = 2 * sim.cost.swap_ms(c) / _MS * m if c <= sim.cache.num_free_host_blocks else math.inf
        best = min(preserve, swap, discard)
        if best == preserve:
            sim.cache.pin(s.sid, until=s.next_ready_at)
        elif best == swap:
            sim.swap_out(s.sid, now)
        # discard: blocks stay in the LRU (freed, still cached)

    def make_room(self, needed: int, now: float, requester: Sess) -> bool:
        return self._evict_by(lambda sid: self.sim.sessions[sid].next_ready_at, requester, needed, now)


class Continuum(Baseline):
    name = "continuum"
    GRID = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)

    def __init__(self, fixed_ttl_s: float | None = None, eta: float = 1.0) -> None:
        self.fixed_ttl_s = fixed_ttl_s
        self.eta = eta
        if fixed_ttl_s is not None:
            self.name = f"continuum-{fixed_ttl_s:g}s"

    def ttl(self, s: Sess) -> float:
        if self.fixed_ttl_s is not None:
            return self.fixed_ttl_s
        assert s.tool is not None
        sim = self.sim
        reload_s = sim.cost.recompute_ms(len(s.tokens)) / _MS
        gain = self.eta * sim.queue_delay_s + reload_s
        best, best_value = 0.0, 0.0
        for tau in (*self.GRID, *sim.latency.quantiles(s.tool)):
            value = sim.latency.cdf(s.tool, tau) * gain - tau
            if value > best_value:
                best, best_value = tau, value
        return best

    def on_gap(self, s: Sess, now: float) -> None:
        tau = self.ttl(s)
        if tau > 0:
            self.sim.cache.pin(s.sid, until=now + tau)

    def make_room(self, needed: int, now: float, requester: Sess) -> bool:
        pinned = [sid for sid in self.sim.pinned() if sid != requester.sid]
        pinned.sort(key=lambda sid: (-(self.sim.cache.blocks_of(sid).pin_until or math.inf), sid))
        freed = 0
        for sid in pinned:
            if freed >= needed:
                break
            freed += self.sim.cache.release(sid)
        return freed > 0


class KVFlow(Baseline):
    name = "kvflow"

    def on_gap(self, s: Sess, now: float) -> None:
        self.sim.cache.pin(s.sid)

    def estimate(self, sid: SessionId, now: float) -> float:
        s = self.sim.sessions[sid]
        if s.phase not in (Phase.TOOL, Phase.HUMAN) or s.tool is None:
            return 0.0
        return max(0.0, self.sim.latency.mean(s.tool) - (now - s.gap_started_at))

    def make_room(self, needed: int, now: float, requester: Sess) -> bool:
        return self._evict_by(lambda sid: self.estimate(sid, now), requester, needed, now)


class Oracle(Baseline):
    name = "oracle"

    def on_gap(self, s: Sess, now: float) -> None:
        self.sim.cache.pin(s.sid)

    def make_room(self, needed: int, now: float, requester: Sess) -> bool:
        def next_reference(sid: SessionId) -> float:
            s = self.sim.sessions[sid]
            return s.next_ready_at if s.phase in (Phase.TOOL, Phase.HUMAN) else now

        return self._evict_by(next_reference, requester, needed, now)


BASELINES: dict[str, Callable[[], Baseline]] = {
    "vllm": VLLM,
    "infercept": InferCept,
    "continuum": Continuum,
    "continuum-2s": lambda: Continuum(fixed_ttl_s=2.0),
    "kvflow": KVFlow,
    "oracle": Oracle,
}


def make_baseline(name: str) -> Baseline:
    return BASELINES[name]()
