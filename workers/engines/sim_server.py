"""The simulated engine as a process, speaking vLLM's OpenAI-compatible completions API.

``POST /v1/completions`` takes ``prompt`` (text) or ``prompt_runs`` (token runs,
see ``services.programs.base.TokenRun``), ``max_tokens``, ``request_id`` and
``session_id``; it answers like vLLM (``choices``, ``usage`` with
``prompt_tokens_details.cached_tokens``) plus an ``agentlog`` object with the
simulated timings. ``GET /stats`` reports requests served and replayed;
``GET /kv_events?after=N`` the KV events after sequence number N;
``GET /health`` answers 200.

The engine runs one request at a time (no batching: a simplification of
vLLM's continuous batching; requests queue and ``queue_ms`` says for how
long). Each request takes the simulated prefill + decode time, multiplied by
``--time-scale``, in real time.

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
import json
import logging
import os
import time
import zlib
from collections import deque
from pathlib import Path
from typing import Any

from aiohttp import web

from schemas.events import SessionId
from services.engine.cost import CostModel
from services.engine.kv_cache import KVEvent, PagedKVCache
from services.engine.sim import SimEngine
from services.programs.base import Prompt, TokenRun, output_run
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


def text_token_ids(text: str) -> list[int]:
    """A stand-in tokenizer for text prompts: one token per whitespace-separated word."""
    return [zlib.crc32(word.encode()) % 32_000 for word in text.split()]


class SimServer:
    def __init__(self, engine: SimEngine, state_dir: Path, *, engine_id: str, time_scale: float) -> None:
        self.engine = engine
        self.engine_id = engine_id
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
        self.kv_events: deque[dict[str, Any]] = deque(maxlen=100_000)
        self.kv_seq = 0
        self._lock = asyncio.Lock()
        self._started = time.monotonic()

    def now(self) -> float:
        """Engine time in simulated seconds (wall time divided by the time scale)."""
        return (time.monotonic() - self._started) / max(self.time_scale, 1e-9)

    async def completions(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            request_id = str(body["request_id"])
            session_id = str(body.get("session_id") or request_id)
            max_tokens = int(body.get("max_tokens", 16))
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"bad request: {e}"}, status=400)
        if request_id in self.served:
            self.num_replayed += 1
            response = dict(self.served[request_id])
            response["agentlog"] = {**response["agentlog"], "replayed": True}
            return web.json_response(response)
        if "prompt_runs" in body:
            prompt = Prompt(tuple(TokenRun(str(seed), int(count)) for seed, count in body["prompt_runs"]))
            token_ids = prompt.token_ids()
            text = f"<{max_tokens} simulated tokens>"
        else:
            token_ids = text_token_ids(str(body.get("prompt", "")))
            text = json.dumps({"answer": f"simulated answer to {len(token_ids)} prompt tokens"})
        if not token_ids:
            return web.json_response({"error": "empty prompt"}, status=400)
        # What the simulated model "says" is the request's own token run, so a trace replay
        # (services.programs.trace) puts exactly these tokens in its next prompt.
        output_ids = output_run(request_id, max_tokens).token_ids()
        queued = time.monotonic()
        async with self._lock:
            queue_ms = (time.monotonic() - queued) * 1000 / max(self.time_scale, 1e-9)
            try:
                result = self.engine.call(
                    SessionId(session_id), token_ids, max_tokens, now=self.now(), output_token_ids=output_ids
                )
            except Exception as e:  # e.g. a prompt larger than the whole KV cache
                return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=400)
            await asyncio.sleep((result.prefill_ms + result.decode_ms) / 1000 * self.time_scale)
            for event in result.events:
                self.kv_seq += 1
                self.kv_events.append({"seq": self.kv_seq, **kv_event_json(event)})
        response = {
            "id": request_id,
            "object": "text_completion",
            "model": self.engine_id,
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": result.prompt_tokens,
                "completion_tokens": len(result.output_token_ids),
                "total_tokens": result.prompt_tokens + len(result.output_token_ids),
                "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
            },
            "agentlog": {
                "queue_ms": queue_ms,
                "prefill_ms": result.prefill_ms,
                "decode_ms": result.decode_ms,
                "swapped_in_blocks": result.swapped_in_blocks,
                "replayed": False,
            },
        }
        crash_point("engine.before_record")  # computed, not recorded: a retry computes it again
        self.served[request_id] = response
        self.num_served += 1
        with self.record_path.open("a") as f:
            f.write(json.dumps({"request_id": request_id, "response": response}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        crash_point("engine.after_record")  # recorded, not answered: a retry is answered from the record
        return web.json_response(response)

    async def stats(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "engine_id": self.engine_id,
                "num_served": self.num_served,
                "num_replayed": self.num_replayed,
                "kv_seq": self.kv_seq,
            }
        )

    async def kv_events_after(self, request: web.Request) -> web.Response:
        after = int(request.query.get("after", "0"))
        return web.json_response([e for e in self.kv_events if e["seq"] > after][:5000])

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/stats", self.stats)
        app.router.add_get("/kv_events", self.kv_events_after)
        app.router.add_get("/health", self.health)
        return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workers.engines.sim_server", description=__doc__)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--state-dir", type=Path, required=True, help="where the record of served requests lives")
    parser.add_argument("--engine-id", default="sim-0")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-blocks", type=int, default=8192, help="KV cache capacity in blocks")
    parser.add_argument("--host-blocks", type=int, default=0)
    parser.add_argument("--time-scale", type=float, default=float(os.environ.get("AGENTLOG_TIME_SCALE", "1")))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s engine[{os.getpid()}] %(levelname)s %(message)s")
    cache = PagedKVCache(args.block_size, args.gpu_blocks, args.host_blocks)
    engine = SimEngine(cache, CostModel(block_size=args.block_size))
    server = SimServer(engine, args.state_dir, engine_id=args.engine_id, time_scale=args.time_scale)
    web.run_app(server.app(), host=args.host, port=args.port, print=None, handle_signals=True, access_log=None)


if __name__ == "__main__":
    main()
