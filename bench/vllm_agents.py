"""The trace workload on real vLLM, without and with the cache manager, and the simulator's prediction.

Run::

    python -m bench.vllm_agents [--sessions 24] [--rate 0.2] [--time-scale 0.02] [--blocks 40] [--seed 0]
                                [--url URL --kv-events EP --kv-replay EP --control EP]

(``make bench-vllm``; about 1-2 minutes on 2 cores with the tiny model, ~40 s of it starting vLLM.)

**Workload.** InferCept trace sessions (``traces/``), contexts capped at 960 tokens
(the tiny model's window is 1024), Poisson arrivals at ``--rate`` sessions per trace second.
Each session is driven like an agent: turn i's prompt is its whole context (the shared system
prompt, each turn's new tokens, **the tokens vLLM actually generated**, each tool's result
tokens; synthetic token ids), generating the recorded number of tokens; between turns the
recorded tool duration passes, compressed by ``--time-scale``.

**Engine.** One vLLM server (the CPU build, the tiny random model, ``--blocks`` KV blocks of 32
tokens: small, so the sessions' working set does not fit), ``AgentlogScheduler``. Both modes
run on it, one after the other, with token ids salted per mode (no hits across modes).

**Modes.** ``vllm``: no cache manager; vLLM frees each call's blocks to its LRU. ``manager``:
``services.cache.manager.CacheManager`` (the cache manager worker's logic) in-process, fed
the events the planner and executor would log (``LLMCallStarted/Completed``,
``ToolCallProposed/Started/Completed``, ``SessionFinished``) and the real KV events of the
vLLM server (``workers.engine_bridge.vllm.VllmKVSource``), its decisions carried out by
``VllmActuator`` through the scheduler's control channel: pins with TTL, release, discard,
and releases under pressure in its ranking. Its clock is trace time (wall / time scale).

**Simulator.** ``services.engine.serial.Sim`` on the same sessions and arrivals, with the same
KV pool (blocks of 32 tokens, no host tier), policies ``vllm`` and ``ours``. Its cost model
is Llama-3-8B on an A100, so its job times are not the tiny model's on a CPU; the token counts
and the ratios are what compare.

Printed: prefill tokens computed, tokens served from the cache, hit rate, mean and p95 job
completion time (wall seconds), and manager / vllm ratios, for real vLLM and the simulator.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.cache_fullstack import load_sessions
from bench.cache_policies import cap_context, make_manager
from schemas import events as ev
from schemas.events import SessionId
from services.cache.manager import CacheManager, ManagerConfig
from services.engine.cost import CostModel
from services.engine.serial import Sim
from services.programs.base import Prompt, TokenRun
from services.traces.model import Trace, TraceSession
from workers.engine_bridge.base import ActuationRefused
from workers.engine_bridge.vllm import VllmActuator, VllmKVSource
from workers.engines.vllm.server import VllmServer, VllmServerConfig, repo_root
from workers.engines.vllm_http import token_ids

ENGINE_ID = "vllm-0"
MAX_CONTEXT = 960
VOCAB = 4096


@dataclass
class ModeResult:
    name: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    jct_s: list[float] = field(default_factory=list)
    decisions: dict[str, int] = field(default_factory=dict)
    refused: int = 0
    pressure_releases: int = 0
    output_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    num_calls: int = 0

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_jct(self) -> float:
        return sum(self.jct_s) / len(self.jct_s) if self.jct_s else 0.0

    @property
    def p95_jct(self) -> float:
        if not self.jct_s:
            return 0.0
        ordered = sorted(self.jct_s)
        return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def ids(seed: str, count: int) -> list[int]:
    return token_ids(Prompt((TokenRun(seed, count),)), VOCAB)


class Driver:
    """Runs the sessions of one mode against vLLM (see the module docstring)."""

    def __init__(self, mode: str, url: str, http: aiohttp.ClientSession, time_scale: float) -> None:
        self.mode = mode
        self.url = url
        self.http = http
        self.time_scale = time_scale
        self.result = ModeResult(mode)
        self.t0 = time.monotonic()
        self.manager: CacheManager | None = None
        self.actuator: VllmActuator | None = None
        self._seq = 0

    def now(self) -> float:
        """Trace seconds since the start (the manager's clock)."""
        return (time.monotonic() - self.t0) / self.time_scale

    async def feed(self, session: str, body: Any) -> None:
        """One event into the manager, its decisions into vLLM (manager mode only)."""
        if self.manager is None:
            return
        self._seq += 1
        for decided in self.manager.apply(f"{self.mode}-{self._seq}", SessionId(session), body, self.now()):
            decision = decided.to_event(ENGINE_ID, self.time_scale)
            action = str(decision.action)
            self.result.decisions[action] = self.result.decisions.get(action, 0) + 1
            assert self.actuator is not None
            try:
                await self.actuator.apply(decided.session_id, decision)
            except ActuationRefused:
                self.result.refused += 1

    async def complete(self, session: str, call_id: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "session_id": session,
            "request_id": f"{session}-{call_id}",
        }
        async with self.http.post(f"{self.url}/v1/completions", json=body) as response:
            answer: dict[str, Any] = await response.json()
            if response.status != 200:
                raise RuntimeError(f"vLLM refused {session}/{call_id}: {answer}")
            return answer

    async def session(self, s: TraceSession) -> None:
        await asyncio.sleep(max(0.0, s.arrival_s * self.time_scale - (time.monotonic() - self.t0)))
        began = time.monotonic()
        sid = f"{self.mode}-{s.session_id}"
        context: list[int] = []
        for i, turn in enumerate(s.turns):
            if i == 0 and turn.shared_prefix is not None:
                prefix = turn.shared_prefix
                context += ids(f"{self.mode}:prefix:{prefix.context_id}", prefix.tokens)
                context += ids(f"{sid}:prompt:{i}", max(0, turn.prompt_tokens - prefix.tokens))
            else:
                context += ids(f"{sid}:prompt:{i}", turn.prompt_tokens)
            call = f"llm-{i}"
            await self.feed(
                sid,
                ev.LLMCallStarted(
                    call_id=call, turn=i, engine_id=ENGINE_ID, prompt_tokens=len(context),
                    max_output_tokens=turn.output_tokens, prompt_digest="-",
                ),
            )  # fmt: skip
            answer = await self.complete(sid, call, context, turn.output_tokens)
            usage, choice = answer["usage"], answer["choices"][0]
            metrics = answer.get("metrics") or {}
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            self.result.prompt_tokens += int(usage["prompt_tokens"])
            self.result.cached_tokens += cached
            self.result.output_tokens += int(usage["completion_tokens"])
            self.result.prefill_ms += float(metrics.get("time_to_first_token_ms") or 0)
            self.result.decode_ms += float(metrics.get("generation_time_ms") or 0)
            self.result.num_calls += 1
            context += list(choice.get("token_ids") or [])
            await self.feed(
                sid,
                ev.LLMCallCompleted(
                    call_id=call, engine_id=ENGINE_ID, prompt_tokens=int(usage["prompt_tokens"]),
                    cached_tokens=cached, output_tokens=int(usage["completion_tokens"]), output_text="",
                    finish_reason=str(choice.get("finish_reason")),
                    queue_ms=float(metrics.get("queue_time_ms") or 0) / self.time_scale,
                    prefill_ms=float(metrics.get("time_to_first_token_ms") or 0) / self.time_scale,
                    decode_ms=float(metrics.get("generation_time_ms") or 0) / self.time_scale,
                ),
            )  # fmt: skip
            if turn.tool is None:
                break
            tool_call = f"tool-{i}"
            await self.feed(
                sid,
                ev.ToolCallProposed(
                    call_id=tool_call, tool=turn.tool, arguments_json="{}", effect_class=ev.EffectClass.PURE,
                    idempotency_key=f"{sid}/{tool_call}",
                ),
            )  # fmt: skip
            await self.feed(sid, ev.ToolCallStarted(call_id=tool_call, tool=turn.tool, idempotency_key="-", attempt=1))
            duration = float(turn.tool_duration_s or 0.0)
            await asyncio.sleep(duration * self.time_scale)
            result_tokens = int(turn.tool_result_tokens or 0)
            await self.feed(
                sid,
                ev.ToolCallCompleted(
                    call_id=tool_call, result_json="{}", result_tokens=result_tokens, duration_ms=duration * 1000
                ),
            )
            context += ids(f"{sid}:tool:{i}", result_tokens)
        await self.feed(
            sid, ev.SessionFinished(output_json="{}", num_llm_calls=len(s.turns), num_tool_calls=len(s.turns) - 1)
        )
        self.result.jct_s.append(time.monotonic() - began)

    async def kv_events(self, source: VllmKVSource) -> None:
        """vLLM's KV events of this mode's sessions into the manager (what the bridge logs)."""
        async for batch in source.batches(None):
            for event in batch.events:
                if event.session_id.startswith(f"{self.mode}-"):
                    await self.feed(event.session_id, event.body)


async def run_mode(mode: str, trace: Trace, endpoints: dict[str, str], blocks: int, time_scale: float) -> ModeResult:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        driver = Driver(mode, endpoints["url"], http, time_scale)
        tasks: list[asyncio.Task[None]] = []
        source = None
        if mode == "manager":
            driver.manager = CacheManager(
                ManagerConfig(gpu_total_blocks=blocks - 1, block_size=32, engine_id=ENGINE_ID)
            )
            driver.actuator = VllmActuator(ENGINE_ID, endpoints["control"])
            source = VllmKVSource(ENGINE_ID, endpoints["kv_events"], endpoints["kv_replay"])
            tasks.append(asyncio.create_task(driver.kv_events(source)))
        before = len((await VllmActuator(ENGINE_ID, endpoints["control"]).control.call("status"))["pressure_releases"])
        driver.t0 = time.monotonic()
        await asyncio.gather(*(driver.session(s) for s in trace))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        status = await VllmActuator(ENGINE_ID, endpoints["control"]).control.call("status")
        driver.result.pressure_releases = len(status["pressure_releases"]) - before
        if source is not None:
            await source.aclose()
        if driver.actuator is not None:
            for s in trace:  # leave nothing pinned for the next mode
                await driver.actuator.control.call("release", session=f"{mode}-{s.session_id}")
            await driver.actuator.aclose()
        return driver.result


def calibrated(measured: ModeResult, time_scale: float) -> CostModel:
    """A cost model with the tiny model's measured speed on this CPU, in trace time (the sim's
    clock): prefill per computed token and decode per output token, as vLLM's metrics say."""
    return CostModel(
        block_size=32,
        call_overhead_ms=0.0,
        prefill_ms_per_token=measured.prefill_ms / max(1, measured.computed) / time_scale,
        prefill_attention_ms_per_token_pair=0.0,
        decode_ms_per_token=measured.decode_ms / max(1, measured.output_tokens - measured.num_calls) / time_scale,
    )


def simulate(trace: Trace, blocks: int, cost: CostModel) -> dict[str, ModeResult]:
    out = {}
    for name, policy in (("vllm", "vllm"), ("manager", "ours")):
        m = Sim(trace, make_manager(policy), blocks - 1, 0, cost).run()
        out[name] = ModeResult(name, m.prompt_tokens, m.prompt_tokens - m.computed_tokens, list(m.jct))
    return out


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def print_table(results: dict[str, dict[str, ModeResult]], out: Any = sys.stdout) -> None:
    print(
        f"{'':30}{'prefill computed':>17}{'cached':>9}{'hit rate':>9}{'mean JCT':>10}{'p95 JCT':>9}  decisions",
        file=out,
    )
    for label, rows in results.items():
        unit = "s" if label == "real vLLM" else "*"
        for name in ("vllm", "manager"):
            r = rows[name]
            decisions = ", ".join(f"{k} {v}" for k, v in sorted(r.decisions.items())) or "-"
            if label == "real vLLM" and name == "manager":
                decisions += f"; {r.pressure_releases} pins released under pressure"
            print(
                f"{label + ' ' + name:30}{r.computed:>17}{r.cached_tokens:>9}{r.hit_rate:>9.1%}"
                f"{r.mean_jct:>9.2f}{unit[0]}{r.p95_jct:>8.2f}{unit[0]}  {decisions}",
                file=out,
            )
        a, b = rows["manager"], rows["vllm"]
        cached = ratio(a.cached_tokens, b.cached_tokens)
        print(
            f"{label + ' manager/vllm':30}{ratio(a.computed, b.computed):>17}{cached:>9}"
            f"{'':>9}{ratio(a.mean_jct, b.mean_jct):>10}{ratio(a.p95_jct, b.p95_jct):>9}",
            file=out,
        )
    print(
        "real job times: wall seconds (tools compressed); (*) simulator: trace seconds",
        file=out,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_agents", description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--rate", type=float, default=0.2, help="session arrivals per trace second")
    parser.add_argument("--time-scale", type=float, default=0.02, help="wall seconds per trace second of tools")
    parser.add_argument("--blocks", type=int, default=40, help="vLLM's KV pool, blocks of 32 tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=str(repo_root() / ".cache" / "tiny-llama"))
    parser.add_argument("--url", help="a running server (with --kv-events, --kv-replay, --control); default: start one")
    parser.add_argument("--kv-events")
    parser.add_argument("--kv-replay")
    parser.add_argument("--control")
    args = parser.parse_args(argv)

    sessions = load_sessions(args.sessions, args.rate, args.seed)
    trace = cap_context(Trace(tuple(sessions)), MAX_CONTEXT)
    print(
        f"{len(trace)} InferCept sessions, {sum(len(s.turns) for s in trace)} LLM calls, contexts <= {MAX_CONTEXT} "
        f"tokens; KV pool {args.blocks} blocks x 32 tokens; tools x{args.time_scale:g}"
    )
    server = None
    if args.url:
        endpoints = {"url": args.url, "kv_events": args.kv_events, "kv_replay": args.kv_replay, "control": args.control}
    else:
        run_dir = Path(tempfile.mkdtemp(prefix="agentlog-bench-vllm-"))
        config = VllmServerConfig(model=args.model, run_dir=run_dir, num_gpu_blocks=args.blocks)
        began = time.monotonic()
        server = VllmServer(config).start()
        print(f"vLLM ready in {time.monotonic() - began:.0f} s")
        endpoints = {
            "url": config.url, "kv_events": config.kv_events, "kv_replay": config.kv_replay, "control": config.control
        }  # fmt: skip
    try:
        real = {}
        for mode in ("vllm", "manager"):
            began = time.monotonic()
            real[mode] = asyncio.run(run_mode(mode, trace, endpoints, args.blocks, args.time_scale))
            print(f"{mode}: {time.monotonic() - began:.1f} s")
    finally:
        if server is not None:
            server.stop()
    cost = calibrated(real["vllm"], args.time_scale)
    print(
        f"calibrated cost model (trace ms): prefill {cost.prefill_ms_per_token:.2f}/token, "
        f"decode {cost.decode_ms_per_token:.1f}/token"
    )
    print_table(
        {
            "real vLLM": real,
            "sim (A100 model)": simulate(trace, args.blocks, CostModel(block_size=32)),
            "sim (calibrated)": simulate(trace, args.blocks, cost),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
