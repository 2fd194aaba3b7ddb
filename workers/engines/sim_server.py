"""The simulated engine as a process, speaking vLLM's OpenAI-compatible API.

``POST /v1/completions`` takes ``prompt`` (text) or ``prompt_runs`` (token runs,
see ``services.programs.base.TokenRun``), ``max_tokens``, ``request_id`` and
``session_id``; it answers like vLLM (``choices``, ``usage`` with
``prompt_tokens_details.cached_tokens``) plus an ``agentlog`` object with the
simulated timings. ``GET /stats`` reports requests served and replayed and the
cache's block counts; ``GET /health`` answers 200.

``POST /v1/chat/completions`` answers OpenAI's chat API (``messages``, ``tools``,
``tool_choice``, ``max_tokens``/``max_completion_tokens``, ``stream`` with
``stream_options.include_usage``) with the same engine call: the prompt is the
rendered messages (``services.programs.sdk.render_messages``), so a session's next
turn hits its cached prefix. What the model says (text or tool calls, deterministic
in the request's content, malformed calls on request) is ``services.engine.chat``'s.
Errors have OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``): 400
for a bad body, 404 for a model this engine does not serve (``--model``, listed by
``GET /v1/models``), 401 without the key when ``--api-key`` is set. A stream's last
chunk before ``[DONE]`` carries the ``agentlog`` timings.

**KV events** come in numbered batches, like vLLM's ZMQ stream: one batch per engine
step (a call, or a control command), ``seq`` gapless from 1 within an ``epoch`` (a
random id of this process run: a restarted engine starts a new epoch and forgets the
old one's events). ``GET /kv_events?after=N`` answers ``{"epoch", "first_seq",
"last_seq", "batches": [{"seq", "at", "events": [...]}, ...]}`` with the batches after
N still in the replay buffer (the newest ``--kv-buffer`` batches); ``first_seq > N + 1``
means the ones in between are gone.

**Cache control** (``POST /kv_control``, the engine bridge's actuator): ``{"session_id",
"action", "ttl_ms", "score"}`` with a ``CacheAction`` value: ``PRESERVE`` pins the
session's blocks until ``ttl_ms`` of log time from now (log time is wall-clock time;
the engine divides it by ``--time-scale``), ``RELEASE`` unpins them (they stay cached,
LRU-evictable), ``DISCARD`` uncaches them, ``SWAP`` moves them to the host tier,
``PREFETCH`` brings them back and pins them like a ``PRESERVE``. Answers
``{"applied": true, "blocks": n}``, or status 409 with ``{"applied": false, "reason"}``
when the cache refuses (no host room, the session is in a call). Without any control
the engine is the vLLM-like baseline: blocks are freed when each call ends and reused
LRU.

**Pressure valve.** A call that does not fit takes the pin the cache manager ranked
lowest (the PRESERVE's ``score``), then the next, until it fits (``CacheControl.relieve``):
the pinned blocks move to the host tier when it has room (the call pays the transfer, and a
``swapped`` event reports it like a ``SWAP``'s), else the pin is released
(``num_forced_swaps`` and ``num_forced_releases`` in ``/stats``): a pin never makes a call fail.

The engine runs one request at a time (no batching: a simplification of
vLLM's continuous batching; requests queue and ``queue_ms`` says for how
long). Each request takes the simulated prefill + decode time, multiplied by
``--time-scale``, in real time.

**Priorities.** A request may carry vLLM's ``priority`` (an integer, lower is served first,
default 0; the planner's and the gateway's are ``services.scheduling``'s program-level
priorities): waiting requests are served lowest first, ties (and requests without one) in arrival
order, as vLLM's ``--scheduling-policy priority``. A control command waits like a request of
priority 0. A priority that is not an integer is refused with 400.

**Repeated request ids.** A request id the engine has already served is
answered from its record (``replayed: true``) without running again, and the
record is a file, so this survives an engine restart. The planner retries an
LLM call under the same request id after a crash; this is how "a recorded LLM
output is never requested again" extends to "an LLM call is never computed
twice", and ``/stats`` counts both.

Crash points (workers/crash.py): ``engine.before_record`` (computed, not
recorded) and ``engine.after_record`` (recorded, not answered).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import hmac
import json
import logging
import math
import os
import time
import uuid
import zlib
from collections import deque
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from aiohttp import web

from schemas.events import CacheAction, SessionId
from services.engine.chat import (
    ChatRequestError,
    chat_reply,
    completion_json,
    error_json,
    parse_chat_request,
    stream_chunks,
)
from services.engine.control import CacheControl, Relieved
from services.engine.cost import CostModel
from services.engine.kv_cache import KVCacheError, KVEvent, OutOfBlocks, PagedKVCache
from services.engine.sim import SimEngine, SimResult
from services.programs.base import Prompt, TokenRun, output_run
from services.scheduling import request_priority
from workers.crash import crash_point

_log = logging.getLogger(__name__)


def kv_event_json(event: KVEvent) -> dict[str, Any]:
    return {
        "kind": event.kind,
        "tier": str(event.tier),
        "block_hashes": list(event.block_hashes),
        "session_id": event.session_id,
        "num_tokens": event.num_tokens,
        "parent_block_hash": event.parent_block_hash,
    }


class _Refused(Exception):
    """The engine cannot run a call (it does not fit the cache, even with every pin released)."""


def text_token_ids(text: str) -> list[int]:
    """A stand-in tokenizer for text prompts: one token per whitespace-separated word."""
    return [zlib.crc32(word.encode()) % 32_000 for word in text.split()]


def _count(value: object, name: str, maximum: int) -> int:
    """A token count from a request: a whole number from 0 to ``maximum``."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    count = int(value)
    if not 0 <= count <= maximum:
        raise ValueError(f"{name} {count} is outside 0..{maximum} (the KV cache holds {maximum} tokens)")
    return count


def _prompt_runs(value: object, capacity: int) -> tuple[TokenRun, ...]:
    """``prompt_runs``: a list of ``[seed, count]`` pairs, ``capacity`` tokens at most in all."""
    if not isinstance(value, list):
        raise TypeError(f"prompt_runs must be a list of [seed, count] pairs, not {type(value).__name__}")
    runs = []
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            raise TypeError(f"prompt_runs must be a list of [seed, count] pairs, not {item!r:.60}")
        runs.append(TokenRun(str(item[0]), _count(item[1], "a prompt run's count", capacity)))
    total = sum(run.count for run in runs)
    if total > capacity:
        raise ValueError(f"the prompt has {total} tokens; the KV cache holds {capacity}")
    return tuple(runs)


class PriorityGate:
    """The engine's one slot: whoever holds it runs; waiters enter lowest priority first, ties in
    arrival order (so FIFO when nobody gives a priority, which is what ``asyncio.Lock`` did).

    A heap of futures instead of a lock: a lock wakes waiters in arrival order only. A waiter that
    is cancelled is skipped when its turn comes; one cancelled just after being handed the slot
    passes it on."""

    def __init__(self) -> None:
        self._held = False
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = 0

    @contextlib.asynccontextmanager
    async def hold(self, priority: int = 0) -> AsyncIterator[None]:
        if self._held or self._waiters:
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiters, (priority, self._seq, turn))
            self._seq += 1
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._pass_on()  # handed the slot as it was cancelled: give it to the next
                raise
        else:
            self._held = True
        try:
            yield
        finally:
            self._pass_on()

    @property
    def num_waiting(self) -> int:
        return sum(1 for _, _, turn in self._waiters if not turn.done())

    @property
    def held(self) -> bool:
        """Whether a request holds the engine now."""
        return self._held

    def _pass_on(self) -> None:
        while self._waiters:
            _, _, turn = heapq.heappop(self._waiters)
            if not turn.done():
                turn.set_result(None)  # the slot stays held: it changes hands
                return
        self._held = False


def _finite(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, not {value!r}")
    return number


class SimServer:
    def __init__(
        self,
        engine: SimEngine,
        state_dir: Path,
        *,
        engine_id: str,
        time_scale: float,
        kv_buffer: int = 10_000,
        model: str = "sim",
        api_key: str | None = None,
    ) -> None:
        self.engine = engine
        self.engine_id = engine_id
        self.model = model  # the served model name (a request may name it or the engine id)
        self._api_key = api_key  # like vLLM's --api-key: required on /v1/ when set
        self.time_scale = time_scale
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        self.record_path = state_dir / "served.jsonl"
        self.served: dict[str, dict[str, Any]] = {}
        if self.record_path.exists():
            for line in self.record_path.read_text().splitlines():
                if line.strip():
                    entry = json.loads(line)
                    self.served[entry["request_id"]] = entry["response"]
        self.num_served = len(self.served)
        self.num_replayed = 0
        self.epoch = uuid.uuid4().hex[:12]
        self.kv_batches: deque[dict[str, Any]] = deque(maxlen=kv_buffer)
        self.kv_seq = 0
        self.num_controls = 0
        self.num_forced_releases = 0  # pins the pressure valve released for a call that did not fit
        self.num_forced_swaps = 0  # pins it moved to the host tier instead
        self.control = CacheControl(engine.cache)  # carries /kv_control's decisions out; the pressure valve
        self._gate = PriorityGate()
        self._started = time.monotonic()
        self._created = time.time()

    def now(self) -> float:
        """Engine time in simulated seconds (wall time divided by the time scale)."""
        return (time.monotonic() - self._started) / max(self.time_scale, 1e-9)

    async def completions(self, request: web.Request) -> web.Response:
        capacity = self.engine.cache.num_gpu_blocks * self.engine.cache.block_size
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise TypeError(f"the body must be a JSON object, not {type(body).__name__}")
            request_id = str(body["request_id"])
            session_id = str(body.get("session_id") or request_id)
            # Bounded by the cache before anything is built: more would never fit, and a huge
            # count would build a huge token list first.
            max_tokens = _count(body.get("max_tokens", 16), "max_tokens", capacity)
            runs = _prompt_runs(body["prompt_runs"], capacity) if "prompt_runs" in body else None
            priority = request_priority(body.get("priority"))
        except (ValueError, KeyError, TypeError, OverflowError) as e:
            return web.json_response({"error": f"bad request: {e}"}, status=400)
        if request_id in self.served:
            return web.json_response(self._replay(request_id))
        if runs is not None:
            token_ids = Prompt(runs).token_ids()
            text = f"<{max_tokens} simulated tokens>"
        else:
            token_ids = text_token_ids(str(body.get("prompt", "")))
            text = json.dumps({"answer": f"simulated answer to {len(token_ids)} prompt tokens"})
        if not token_ids:
            return web.json_response({"error": "empty prompt"}, status=400)
        try:
            result, queue_ms = await self._run(request_id, session_id, token_ids, max_tokens, priority)
        except _Refused as e:
            return web.json_response({"error": str(e)}, status=400)
        response = {
            "id": request_id,
            "object": "text_completion",
            "model": self.engine_id,
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": self._usage(result),
            "agentlog": self._timings(result, queue_ms, priority),
        }
        self._record(request_id, response)
        return web.json_response(response)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions`` (``services.engine.chat`` says what the model answers):
        the same engine call, token accounting, KV events and record as ``/v1/completions``; the
        prompt is the rendered messages. ``request_id`` and ``session_id`` are body fields, or the
        headers ``X-Request-Id`` and ``X-Agentlog-Session``; without a request id the call gets a
        random one (and cannot be replayed)."""
        try:
            try:
                body = await request.json()
            except ValueError as e:
                raise ChatRequestError(f"the request body is not JSON: {e}") from None
            chat = parse_chat_request(body)
            if chat.model not in (self.model, self.engine_id):
                raise ChatRequestError(f"the model {chat.model!r} does not exist; this engine serves {self.model!r}",
                                       param="model", status=404, code="model_not_found")  # fmt: skip
            request_id = chat.request_id or request.headers.get("X-Request-Id") or f"chatcmpl-{uuid.uuid4().hex}"
            session_id = chat.session_id or request.headers.get("X-Agentlog-Session") or request_id
            if request_id in self.served:
                if self.served[request_id].get("object") != "chat.completion":
                    raise ChatRequestError(f"request id {request_id!r} was already used for a completion",
                                           param="request_id", status=409, code="request_id_reused")  # fmt: skip
                completion = self._replay(request_id)
            else:
                token_ids = text_token_ids(chat.prompt_text())
                reply = chat_reply(chat, request_id=request_id, num_prompt_tokens=len(token_ids))
                try:
                    result, queue_ms = await self._run(
                        request_id, session_id, token_ids, chat.max_tokens, chat.priority
                    )
                except _Refused as e:
                    raise ChatRequestError(str(e)) from None
                completion = completion_json(
                    reply,
                    request_id=request_id,
                    model=chat.model,
                    created=int(time.time()),
                    usage=self._usage(result),
                    agentlog=self._timings(result, queue_ms, chat.priority),
                )
                self._record(request_id, completion)
        except ChatRequestError as e:
            return web.json_response(error_json(e), status=e.status)
        if not chat.stream:
            return web.json_response(completion)
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await stream.prepare(request)
        for chunk in stream_chunks(completion, include_usage=chat.include_usage):
            await stream.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream

    async def models(self, _request: web.Request) -> web.Response:
        model = {"id": self.model, "object": "model", "created": int(self._created), "owned_by": "agentlog"}
        return web.json_response({"object": "list", "data": [model]})

    def _replay(self, request_id: str) -> dict[str, Any]:
        """The recorded answer to a request id served before, marked ``replayed``."""
        self.num_replayed += 1
        response = dict(self.served[request_id])
        response["agentlog"] = {**response["agentlog"], "replayed": True}
        return response

    async def _run(
        self, request_id: str, session_id: str, token_ids: list[int], max_tokens: int, priority: int = 0
    ) -> tuple[SimResult, float]:
        """One engine call (both endpoints): queue (by ``priority``), run, take the simulated time,
        publish its KV events; ``(result, queue_ms)``. Raises ``_Refused`` when the call cannot run."""
        # What the simulated model "says" is the request's own token run, so a trace replay
        # (services.programs.trace) puts exactly these tokens in its next prompt.
        output_ids = output_run(request_id, max_tokens).token_ids()
        queued = time.monotonic()
        async with self._gate.hold(priority):
            queue_ms = (time.monotonic() - queued) * 1000 / max(self.time_scale, 1e-9)
            self.engine.cache.expire(self.now())  # TTLs end when the engine steps, like vLLM's scheduler
            moved: list[dict[str, Any]] = []  # the pressure valve's swaps, before the call
            while True:
                try:
                    result = self.engine.call(
                        SessionId(session_id), token_ids, max_tokens, now=self.now(), output_token_ids=output_ids
                    )
                    break
                except OutOfBlocks as e:
                    relieved = self._relieve(exclude=session_id)
                    if relieved is None:
                        raise _Refused(f"{type(e).__name__}: {e}") from None
                    if blocks := relieved.swapped_blocks:
                        swap_ms = self.engine.cost.swap_ms(blocks)
                        moved.append(self._swap_event(relieved.session_id, "GPU", "CPU", blocks, swap_ms))
                except Exception as e:  # e.g. a prompt larger than the whole KV cache
                    raise _Refused(f"{type(e).__name__}: {e}") from None
            # The valve's transfers occupy the engine before the call, like a SWAP's.
            valve_ms = sum(event["duration_ms"] for event in moved)
            engine_ms = valve_ms + result.swap_ms + result.prefill_ms + result.decode_ms
            await asyncio.sleep(engine_ms / 1000 * self.time_scale)
            hit = {
                "kind": "hit",
                "session_id": session_id,
                "call_id": request_id.rsplit("/", 1)[-1],
                "cached_tokens": result.cached_tokens,
                "prompt_tokens": result.prompt_tokens,
                "tier": "GPU",
            }
            extra = [*moved, hit]
            if result.swapped_in_blocks:
                swapped_tokens = result.prompt_tokens - result.computed_tokens - result.cached_tokens
                extra.append({**hit, "cached_tokens": swapped_tokens, "tier": "CPU"})  # the host tier's hit
                extra.append(self._swap_event(session_id, "CPU", "GPU", result.swapped_in_blocks, result.swap_ms))
            self._publish(result.events, extra)
        return result, queue_ms

    @staticmethod
    def _usage(result: SimResult) -> dict[str, Any]:
        return {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.output_token_ids),
            "total_tokens": result.prompt_tokens + len(result.output_token_ids),
            # Like vLLM, which counts tokens loaded from an external KV tier as cached: every
            # prompt token not prefilled (GPU prefix hits and blocks swapped back in).
            "prompt_tokens_details": {"cached_tokens": result.prompt_tokens - result.computed_tokens},
        }

    @staticmethod
    def _timings(result: SimResult, queue_ms: float, priority: int) -> dict[str, Any]:
        return {
            "priority": priority,  # the priority it was served at (0: none given), in the record too
            "queue_ms": queue_ms,
            "prefill_ms": result.prefill_ms,
            "decode_ms": result.decode_ms,
            "swapped_in_blocks": result.swapped_in_blocks,
            "replayed": False,
        }

    def _record(self, request_id: str, response: dict[str, Any]) -> None:
        crash_point("engine.before_record")  # computed, not recorded: a retry computes it again
        self.served[request_id] = response
        self.num_served += 1
        with self.record_path.open("a") as f:
            f.write(json.dumps({"request_id": request_id, "response": response}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        crash_point("engine.after_record")  # recorded, not answered: a retry is answered from the record

    def _relieve(self, exclude: str) -> Relieved | None:
        """The pressure valve (``CacheControl.relieve``): a pinned cache must never turn into a
        failed call."""
        relieved = self.control.relieve(SessionId(exclude))
        if relieved is None:
            return None
        if relieved.swapped_blocks:
            self.num_forced_swaps += 1
            _log.info("moved the pin of %s to the host tier to make room (%d blocks, score %.3g)",
                      relieved.session_id, relieved.swapped_blocks, relieved.score)  # fmt: skip
        else:
            self.num_forced_releases += 1
            _log.info("released the pin of %s to make room (score %.3g)", relieved.session_id, relieved.score)
        return relieved

    def _swap_event(self, session_id: str, from_tier: str, to_tier: str, blocks: int, ms: float) -> dict[str, Any]:
        return {"kind": "swapped", "session_id": session_id, "from_tier": from_tier, "to_tier": to_tier,
                "num_blocks": blocks, "duration_ms": ms}  # fmt: skip

    def _publish(self, events: Iterable[KVEvent], extra: Iterable[dict[str, Any]] = ()) -> None:
        """One batch of KV events (one engine step), numbered like vLLM's stream: the cache's
        block events, then this step's hit and swap reports (``extra``)."""
        encoded = [{**kv_event_json(event), "block_size": self.engine.cache.block_size} for event in events]
        encoded.extend(extra)
        if not encoded:
            return  # like vLLM, a step that changed nothing publishes nothing
        self.kv_seq += 1
        self.kv_batches.append({"seq": self.kv_seq, "at": time.time(), "events": encoded})

    async def stats(self, _request: web.Request) -> web.Response:
        cache = self.engine.cache
        return web.json_response(
            {
                "engine_id": self.engine_id,
                "epoch": self.epoch,
                "num_served": self.num_served,
                "num_replayed": self.num_replayed,
                "num_controls": self.num_controls,
                "num_forced_releases": self.num_forced_releases,
                "num_forced_swaps": self.num_forced_swaps,
                "num_waiting": self._gate.num_waiting,  # requests queued for the engine
                "engine_held": self._gate.held,  # a request is being served
                "kv_seq": self.kv_seq,
                "gpu_blocks": cache.num_gpu_blocks,
                "free_blocks": cache.num_free_blocks,
                "host_free_blocks": cache.num_free_host_blocks,
                "pinned_sessions": sorted(sid for sid in cache.session_ids() if cache.blocks_of(sid).pinned),
            }
        )

    async def kv_events_after(self, request: web.Request) -> web.Response:
        try:
            after = int(request.query.get("after", "0"))
            limit = max(1, min(int(request.query.get("limit", "1000")), 10_000))
        except ValueError as e:
            return web.json_response({"error": f"bad query: {e}"}, status=400)
        first_seq = self.kv_batches[0]["seq"] if self.kv_batches else self.kv_seq + 1
        # Batches are numbered 1.. and kept in order, so the ones after ``after`` are a suffix.
        start = max(0, after + 1 - first_seq)
        batches = [self.kv_batches[i] for i in range(start, min(len(self.kv_batches), start + limit))]
        return web.json_response(
            {"epoch": self.epoch, "first_seq": first_seq, "last_seq": self.kv_seq, "batches": batches}
        )

    async def kv_control(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise TypeError(f"the body must be a JSON object, not {type(body).__name__}")
            session_id = SessionId(str(body["session_id"]))
            action = CacheAction(body["action"])
            ttl_ms = body.get("ttl_ms")
            ttl_s = None if ttl_ms is None else _finite(ttl_ms, "ttl_ms") / 1000
            score = _finite(body.get("score") or 0.0, "score")
        except (ValueError, KeyError, TypeError, OverflowError) as e:
            return web.json_response({"error": f"bad request: {e}"}, status=400)
        cache = self.engine.cache
        async with self._gate.hold():
            now = self.now()
            cache.expire(now)
            try:
                ttl = None if ttl_s is None else ttl_s / max(self.time_scale, 1e-9)  # log time -> engine time
                blocks = self.control.apply(session_id, action, now=now, ttl_s=ttl, score=score)
            except KVCacheError as e:
                self._publish(cache.drain_events())
                return web.json_response({"applied": False, "reason": f"{type(e).__name__}: {e}"}, status=409)
            self.num_controls += 1
            extra = []
            if action in (CacheAction.SWAP, CacheAction.PREFETCH) and blocks:
                # The transfer occupies the engine (one PCIe link, no overlap with compute).
                swap_ms = self.engine.cost.swap_ms(blocks)
                await asyncio.sleep(swap_ms / 1000 * self.time_scale)
                tiers = ("GPU", "CPU") if action is CacheAction.SWAP else ("CPU", "GPU")
                extra.append(self._swap_event(session_id, *tiers, blocks, swap_ms))
            self._publish(cache.drain_events(), extra)
        return web.json_response({"applied": True, "blocks": blocks})

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    @web.middleware
    async def _check_key(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self._api_key and request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self._api_key}".encode()):
                error = ChatRequestError("incorrect API key", status=401, code="invalid_api_key")
                return web.json_response(error_json(error), status=401)
        response: web.StreamResponse = await handler(request)
        return response

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._check_key])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/stats", self.stats)
        app.router.add_get("/kv_events", self.kv_events_after)
        app.router.add_post("/kv_control", self.kv_control)
        app.router.add_get("/health", self.health)
        return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workers.engines.sim_server", description=__doc__)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--state-dir", type=Path, required=True, help="where the record of served requests lives")
    parser.add_argument("--engine-id", default="sim-0")
    parser.add_argument("--model", default="sim", help="the served model name (GET /v1/models)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("AGENTLOG_SIM_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on /v1/ (default AGENTLOG_SIM_API_KEY; none: no key)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-blocks", type=int, default=8192, help="KV cache capacity in blocks")
    parser.add_argument("--host-blocks", type=int, default=0)
    parser.add_argument("--time-scale", type=float, default=float(os.environ.get("AGENTLOG_TIME_SCALE", "1")))
    parser.add_argument("--kv-buffer", type=int, default=10_000, help="KV event batches kept for replay")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s engine[{os.getpid()}] %(levelname)s %(message)s")
    cache = PagedKVCache(args.block_size, args.gpu_blocks, args.host_blocks)
    engine = SimEngine(cache, CostModel(block_size=args.block_size))
    server = SimServer(
        engine,
        args.state_dir,
        engine_id=args.engine_id,
        time_scale=args.time_scale,
        kv_buffer=args.kv_buffer,
        model=args.model,
        api_key=args.api_key,
    )
    web.run_app(server.app(), host=args.host, port=args.port, print=None, handle_signals=True, access_log=None)


if __name__ == "__main__":
    main()
