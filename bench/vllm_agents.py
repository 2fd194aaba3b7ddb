"""The trace workload on real vLLM, without and with the cache manager, and the simulator's prediction.

Run::

    python -m bench.vllm_agents [--regime tiny|long] [--sessions N] [--rate R] [--time-scale F|auto]
                                [--blocks B] [--seed 0] [--url URL --kv-events EP --kv-replay EP --control EP]

(``make bench-vllm``; about 1-2 minutes on 2 cores with the tiny model, ~40 s of it starting vLLM;
the long regime's ``--sessions 6 --rate 1.0 --blocks 600``: 73 minutes for the three modes.)

**Regimes.** ``tiny`` (the default, CI's model): InferCept sessions on the 2-layer tiny model,
contexts under 960 tokens. There a recompute of a few hundred tokens costs nothing, so no
policy can show a gain. ``long``: the regime where recomputation costs real time: the
``long`` model of ``scripts/make_tiny_model.py`` (6 layers, width 768, an 8k window; build it
with ``--shape long .cache/long-llama``), the Continuum SWE-agent trajectories cut at 8,192
tokens (10-19 turns each, contexts growing to 7.5-8k, half-second tool gaps), ``--sessions``
jobs of them at Poisson arrivals, a KV pool smaller than their working set, and tool time
scaled by ``--time-scale auto``: the ratio of this model's measured prefill time per token on
this machine to the cost model's A100/Llama-3-8B one, so a tool gap is as long relative to a
prefill as it was in the trace's deployment.

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
``manager+plas``: the same, and each call carries its program-level priority
(``services.scheduling``, computed as the planner does: its program's recorded progress, the
warm credit while a PRESERVE holds its KV), on a server with ranked pins (below), whose valve
gives contexts up in the programs' order: the manager knows it (``ManagerConfig.ranked_pins``:
no room kept ahead, no release of its own under pressure) and the priorities are
``PROGRAM_ORDER``'s, as for ``plas+hold``. The server then runs ``--scheduling-policy
priority``; the other modes send no priority, which vLLM serves first come first served.
Each call of ``manager+plas`` holds its context when it ends (``agentlog_hold_s``) until the
manager's decision replaces the hold: with no room kept ahead, the call's freed blocks are
otherwise the first the next admitted call takes, before the PRESERVE arrives.
``plas`` (run it with ``--modes``): the priorities without the cache manager, which tells the
scheduling's share of a gain from the manager's. ``plas+hold`` (with ``--modes``): the priorities,
and each call holds its session's context until the session's next call (the request's
``agentlog_hold_s``; released when the session finishes) on a server with ranked pins
(``--ranked-pins``: a waiting call takes no context a program ahead of it holds, it waits), so
memory is served in the programs' order, as the queue is; its priorities leave out the
attained-service term (``PROGRAM_ORDER``, what the server announces to the planner), so that the
programs' order stays put.

**Simulator.** ``services.engine.batching.BatchSim`` (the cache-policy bench's engine model) on
the same sessions and arrivals, with the same KV pool (blocks of 32 tokens, no host tier),
policies ``vllm``, ``vllm+plas``, ``ours``, ``ours+plas`` and ``vllm+plas+hold``: with the cost model
of Llama-3-8B on an A100, and calibrated (``calibrated``) with this model's speeds on this machine, measured before the
modes run, one request at a time (``measure_speeds``: two cold prefills, a decode step after
each, a decode step of four sequences), so that the engine model adds a run's contention
itself. Its job times are trace seconds, printed beside the real ones in wall seconds.

Printed: prefill tokens computed, tokens served from the cache, hit rate, mean and p95 job
completion time (wall seconds), and manager / vllm ratios, for real vLLM and the simulator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.cache_fullstack import load_sessions
from bench.cache_policies import cap_context, make_manager, replicate
from cli.data import CONTINUUM, trace_file
from schemas import events as ev
from schemas.events import SessionId
from services.cache.manager import CacheManager, ManagerConfig
from services.cache.policy import CachePolicy
from services.engine.batching import MAX_NUM_SEQS, BatchSim
from services.engine.cost import CostModel
from services.programs.base import Prompt, TokenRun
from services.scheduling import ProgressBook
from services.traces.continuum import from_continuum
from services.traces.model import Trace, TraceSession
from workers.config import scheduling_config
from workers.engine_bridge.base import ActuationRefused
from workers.engine_bridge.vllm import VllmActuator, VllmKVSource
from workers.engines.vllm.server import VllmServer, VllmServerConfig, repo_root
from workers.engines.vllm_http import token_ids

ENGINE_ID = "vllm-0"
MODES = ("vllm", "plas", "manager", "manager+plas", "plas+hold")
DEFAULT_MODES = ("vllm", "manager", "manager+plas")  # issue 16's three; plas tells what scheduling alone does
MANAGED = frozenset({"manager", "manager+plas"})  # modes that run the cache manager
SCHEDULED = frozenset({"plas", "manager+plas", "plas+hold"})  # modes whose calls carry their program-level priority
# Modes whose calls hold their KV when they end (ranked pins): until the session's next call
# (plas+hold), or until the cache manager's decision replaces the hold (manager+plas: without
# it the call's blocks are free, the first the next admitted call takes, until the PRESERVE lands).
HELD = frozenset({"plas+hold", "manager+plas"})
RANKED = frozenset({"manager+plas", "plas+hold"})  # modes that need a server with ranked pins
HOLD_S = 600.0  # a held context's TTL, wall seconds: far past any tool gap here (a finished session's is released)
# The simulator's name of each mode.
SIM_POLICY = {
    "vllm": "vllm",
    "plas": "vllm+plas",
    "manager": "ours",
    "manager+plas": "ours+plas",
    "plas+hold": "vllm+plas+hold",
}
RUN = uuid.uuid4().hex[:8]
MAX_CONTEXT = 960
BLOCK_SIZE = 32  # tokens a KV block holds: the server's, the manager's and every cost model's here
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
    queue_ms: float = 0.0
    num_calls: int = 0
    preemptions: int = 0  # running requests vLLM preempted (and recomputed) for lack of blocks

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def mean_queue_ms(self) -> float:
        """Mean time a call waited in vLLM's queue before it was scheduled."""
        return self.queue_ms / self.num_calls if self.num_calls else 0.0

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
        self.control: VllmActuator | None = None
        # plas, manager+plas: each call's program-level priority, from the events it is fed.
        # The planner's --scheduling for this mode: on ranked pins, ranks that stay put (programs).
        scheduling = "off" if mode not in SCHEDULED else "programs" if mode in RANKED else "plas"
        config = scheduling_config(scheduling, default="off")
        self.book = ProgressBook(config) if config is not None else None
        self._seq = 0

    def session_id(self, s: TraceSession) -> str:
        """The session's id on vLLM: per mode and per run (its token ids derive from it), so that
        no mode, and no earlier run on the same server, shares a cached block with another."""
        return f"{self.mode}-{RUN}-{s.session_id}"

    def now(self) -> float:
        """Trace seconds since the start (the manager's clock)."""
        return (time.monotonic() - self.t0) / self.time_scale

    async def feed(self, session: str, body: Any) -> None:
        """One event into the progress book (scheduled modes) and the manager, its decisions into
        vLLM (managed modes)."""
        now = self.now()
        if self.book is not None:
            self.book.logged(session, body, now)
        if self.manager is None:
            return
        self._seq += 1
        for decided in self.manager.apply(f"{self.mode}-{self._seq}", SessionId(session), body, now):
            if self.book is not None:
                self.book.logged(decided.session_id, decided.to_event(ENGINE_ID), now)
            decision = decided.to_event(ENGINE_ID, self.time_scale)
            action = str(decision.action)
            self.result.decisions[action] = self.result.decisions.get(action, 0) + 1
            assert self.actuator is not None
            try:
                await self.actuator.apply(decided.session_id, decision)
            except ActuationRefused:
                self.result.refused += 1

    def priority(self, session: str) -> int | None:
        """The call's program-level priority, as the planner computes it (scheduled modes only):
        from its program's progress, on the manager's clock, warm while a PRESERVE holds its KV."""
        return None if self.book is None else self.book.priority(session, self.now())

    async def complete(
        self, session: str, call_id: str, prompt: list[int], max_tokens: int, priority: int | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "session_id": session,
            "request_id": f"{session}-{call_id}",
        }
        if priority is not None:
            body["priority"] = priority
        if self.mode in HELD:
            body["vllm_xargs"] = {"agentlog_hold_s": HOLD_S}
        async with self.http.post(f"{self.url}/v1/completions", json=body) as response:
            answer: dict[str, Any] = await response.json()
            if response.status != 200:
                raise RuntimeError(f"vLLM refused {session}/{call_id}: {answer}")
            return answer

    async def session(self, s: TraceSession) -> None:
        await asyncio.sleep(max(0.0, s.arrival_s * self.time_scale - (time.monotonic() - self.t0)))
        began = time.monotonic()
        sid = self.session_id(s)
        context: list[int] = []
        for i, turn in enumerate(s.turns):
            if i == 0 and turn.shared_prefix is not None:
                prefix = turn.shared_prefix
                context += ids(f"{self.mode}:{RUN}:prefix:{prefix.context_id}", prefix.tokens)
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
            answer = await self.complete(sid, call, context, turn.output_tokens, self.priority(sid))
            usage, choice = answer["usage"], answer["choices"][0]
            metrics = answer.get("metrics") or {}
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            self.result.prompt_tokens += int(usage["prompt_tokens"])
            self.result.cached_tokens += cached
            self.result.queue_ms += float(metrics.get("queue_time_ms") or 0)
            self.result.num_calls += 1
            context += list(choice.get("token_ids") or [])
            completed = ev.LLMCallCompleted(
                call_id=call, engine_id=ENGINE_ID, prompt_tokens=int(usage["prompt_tokens"]),
                cached_tokens=cached, output_tokens=int(usage["completion_tokens"]), output_text="",
                finish_reason=str(choice.get("finish_reason")),
                queue_ms=float(metrics.get("queue_time_ms") or 0) / self.time_scale,
                prefill_ms=float(metrics.get("time_to_first_token_ms") or 0) / self.time_scale,
                decode_ms=float(metrics.get("generation_time_ms") or 0) / self.time_scale,
            )  # fmt: skip
            await self.feed(sid, completed)
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
        if self.control is not None:  # held modes: nothing will use a finished session's context again
            await self.control.control.call("release", session=sid)
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
        if mode in HELD:
            driver.control = VllmActuator(ENGINE_ID, endpoints["control"])
        tasks: list[asyncio.Task[None]] = []
        source = None
        if mode in MANAGED:
            driver.manager = CacheManager(
                ManagerConfig(
                    gpu_total_blocks=blocks - 1, block_size=BLOCK_SIZE, engine_id=ENGINE_ID, ranked_pins=mode in RANKED
                ),
                CachePolicy(cost=CostModel(block_size=BLOCK_SIZE)),  # the engine's blocks, as the worker builds it
            )
            driver.actuator = VllmActuator(ENGINE_ID, endpoints["control"])
            source = VllmKVSource(ENGINE_ID, endpoints["kv_events"], endpoints["kv_replay"])
            tasks.append(asyncio.create_task(driver.kv_events(source)))
        before = len((await VllmActuator(ENGINE_ID, endpoints["control"]).control.call("status"))["pressure_releases"])
        preempted = await preemptions(http, endpoints["url"])
        driver.t0 = time.monotonic()
        await asyncio.gather(*(driver.session(s) for s in trace))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        status = await VllmActuator(ENGINE_ID, endpoints["control"]).control.call("status")
        driver.result.pressure_releases = len(status["pressure_releases"]) - before
        driver.result.preemptions = await preemptions(http, endpoints["url"]) - preempted
        if source is not None:
            await source.aclose()
        if driver.actuator is not None:
            for s in trace:  # leave nothing pinned for the next mode
                await driver.actuator.control.call("release", session=driver.session_id(s))
            await driver.actuator.aclose()
        if driver.control is not None:
            await driver.control.aclose()
        return driver.result


async def preemptions(http: aiohttp.ClientSession, url: str) -> int:
    """vLLM's count of preempted requests so far (its Prometheus counter)."""
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    return sum(
        round(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("vllm:num_preemptions_total")
    )


@dataclass(frozen=True)
class Speeds:
    """The model's speeds on this machine, each measured with nothing else running (wall ms):
    a cold prefill of ``short`` and of ``long`` tokens (time to first token), a decode step of one
    sequence after each of them, and a decode step of ``batch`` sequences after ``short`` each."""

    short: int
    long: int
    prefill_short_ms: float
    prefill_long_ms: float
    step_short_ms: float
    step_long_ms: float
    batch: int
    batch_step_ms: float
    steps: int  # decode steps each step time is the mean of


def calibrated(speeds: Speeds, time_scale: float) -> CostModel:
    """The cost model of these speeds, in trace time (the sim's clock: wall ms / ``time_scale``).

    Each term is fitted to measurements taken alone, so the batching engine model adds the
    contention of a run itself (a call's decode time inside a run also holds the prefills of
    the calls batched with it, so fitting to a run's own timings would count them twice):

    - prefill ``t(n) = a n + b n (n + 1) / 2`` through the two cold prefills (``a``: per token,
      ``b``: per attended pair);
    - a decode step of one sequence at context ``c``, ``d + k c`` through the two single decode
      steps (``k``: reading one token's KV; ``d``: the rest);
    - a step of ``B`` sequences is ``d - p + B p + k C``: ``p``, the per-sequence share of ``d``,
      from the batched step."""
    sp = speeds
    n1, n2 = sp.short, sp.long
    # Solve a n + b n(n+1)/2 = t for (a, b) through the two prefills.
    p1, p2 = n1 * (n1 + 1) / 2, n2 * (n2 + 1) / 2
    det = n1 * p2 - n2 * p1
    b = max(0.0, (n1 * sp.prefill_long_ms - n2 * sp.prefill_short_ms) / det)
    a = max(0.0, (sp.prefill_short_ms - b * p1) / n1)
    # A step's mean context is the prompt plus half the tokens generated meanwhile.
    c1, c2 = n1 + (sp.steps - 1) / 2, n2 + (sp.steps - 1) / 2
    k = max(0.0, (sp.step_long_ms - sp.step_short_ms) / (c2 - c1))
    d = max(0.0, sp.step_short_ms - k * c1)
    per_sequence = (sp.batch_step_ms - sp.step_short_ms) / (sp.batch - 1) - k * c1
    per_sequence = min(d, max(0.0, per_sequence))
    kv_bytes = CostModel().kv_bytes_per_token
    return CostModel(
        block_size=BLOCK_SIZE,
        call_overhead_ms=0.0,
        prefill_ms_per_token=a / time_scale,
        prefill_attention_ms_per_token_pair=b / time_scale,
        decode_ms_per_token=d / time_scale,
        decode_ms_per_sequence=per_sequence / time_scale,
        # The KV read per context token, k ms, as the model's bandwidth term (kv bytes / bandwidth).
        hbm_bytes_per_s=kv_bytes / (k / time_scale / 1000) if k > 0 else math.inf,
    )


def simulate(trace: Trace, blocks: int, cost: CostModel, modes: tuple[str, ...]) -> dict[str, ModeResult]:
    """The modes on the batching engine model (``BatchSim``, the cache-policy bench's engine), the
    same KV pool and no host tier: each mode's ``SIM_POLICY``."""
    out = {}
    for name in modes:
        m = BatchSim(trace, make_manager(SIM_POLICY[name]), blocks - 1, 0, cost, MAX_NUM_SEQS).run()
        out[name] = ModeResult(name, m.prompt_tokens, m.prompt_tokens - m.computed_tokens, list(m.jct))
    return out


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def print_table(results: dict[str, dict[str, ModeResult]], out: Any = sys.stdout) -> None:
    print(
        f"{'':32}{'prefill computed':>17}{'cached':>9}{'hit rate':>9}{'mean JCT':>10}{'p95 JCT':>9}"
        f"{'queue/call':>11}{'preempted':>10}  decisions",
        file=out,
    )
    for label, rows in results.items():
        unit = "s" if label == "real vLLM" else "*"
        real = label == "real vLLM"
        for name, r in rows.items():
            decisions = ", ".join(f"{k} {v}" for k, v in sorted(r.decisions.items())) or "-"
            if real and name in MANAGED:
                decisions += f"; {r.pressure_releases} pins released under pressure"
            print(
                f"{label + ' ' + name:32}{r.computed:>17}{r.cached_tokens:>9}{r.hit_rate:>9.1%}"
                f"{r.mean_jct:>9.2f}{unit[0]}{r.p95_jct:>8.2f}{unit[0]}"
                f"{(f'{r.mean_queue_ms:.0f} ms' if real else '-'):>11}{(r.preemptions if real else '-'):>10}"
                f"  {decisions}",
                file=out,
            )
        b = rows.get("vllm")
        for name, a in rows.items():
            if b is None or name == "vllm":
                continue
            print(
                f"{label + ' ' + name + '/vllm':32}{ratio(a.computed, b.computed):>17}"
                f"{ratio(a.cached_tokens, b.cached_tokens):>9}{'':>9}{ratio(a.mean_jct, b.mean_jct):>10}"
                f"{ratio(a.p95_jct, b.p95_jct):>9}{(ratio(a.mean_queue_ms, b.mean_queue_ms) if real else '-'):>11}",
                file=out,
            )
    print(
        "real job times: wall seconds (tools compressed); (*) simulator: trace seconds; "
        "X/vllm: mode X over stock vLLM (below 1: fewer tokens, shorter jobs)",
        file=out,
    )


@dataclass(frozen=True)
class Regime:
    """Defaults of one regime (see the module docstring); every one can be overridden."""

    model: str
    max_context: int
    sessions: int
    rate: float
    blocks: int
    time_scale: str


REGIMES = {
    "tiny": Regime(".cache/tiny-llama", MAX_CONTEXT, 24, 0.2, 40, "0.02"),
    "long": Regime(".cache/long-llama", 8192, 10, 0.05, 640, "auto"),
}


def workload(regime: str, sessions: int, rate: float, seed: int, max_context: int) -> tuple[str, Trace]:
    if regime == "tiny":
        return "InferCept", cap_context(Trace(tuple(load_sessions(sessions, rate, seed))), max_context)
    raw = json.loads(trace_file(CONTINUUM).read_text())
    base = cap_context(from_continuum(raw, arrival_rate_per_s=1.0, rng=random.Random(seed)), max_context)
    copies = -(-sessions // max(1, len(base)))
    jobs = replicate(base, copies, rate, random.Random(seed))
    return "Continuum SWE-agent", Trace(jobs.sessions[:sessions])


def model_window(model: str, regime: Regime) -> int:
    """vLLM's ``--max-model-len``: room past the regime's longest context, within the model's window
    (vLLM refuses more than its ``max_position_embeddings``; the long model's is exactly 8,192)."""
    wanted = regime.max_context + 256
    config = json.loads((Path(model) / "config.json").read_text())
    return min(wanted, int(config.get("max_position_embeddings") or wanted))


async def measure_speeds(url: str, long: int, batch: int = 4, steps: int = 64, repeats: int = 2) -> Speeds:
    """This model's speeds on this machine (``Speeds``), after a warm-up; prompts of ``long // 4``
    and ``long`` tokens, salted so that nothing is a prefix hit. Each number is the least of
    ``repeats`` measurements (a first request of a shape can pay a one-time cost)."""
    short = max(32, long // 4)
    salt = uuid.uuid4().hex  # never a prefix hit, not even on a server that ran this before

    async def call(driver: Driver, name: str, tokens: int) -> tuple[float, float]:
        """(time to first token, decode time per step) of one cold request of ``tokens`` tokens."""
        answer = await driver.complete(f"calibrate-{salt}-{name}", "llm-0", ids(f"calibrate:{salt}:{name}", tokens),
                                       steps + 1)  # fmt: skip
        metrics = answer.get("metrics") or {}
        ttft = float(metrics.get("time_to_first_token_ms") or 0.0)
        return ttft, float(metrics.get("generation_time_ms") or 0.0) / steps

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        driver = Driver("calibrate", url, http, 1.0)
        await call(driver, "warm-up", long)  # the first call compiles and warms up
        shorts = [await call(driver, f"short-{i}", short) for i in range(repeats)]
        longs = [await call(driver, f"long-{i}", long) for i in range(repeats)]
        batched = []
        for i in range(repeats):
            together = await asyncio.gather(*(call(driver, f"batch-{i}-{j}", short) for j in range(batch)))
            batched.append(sum(step for _, step in together) / batch)
    return Speeds(
        short=short, long=long, prefill_short_ms=min(t for t, _ in shorts), prefill_long_ms=min(t for t, _ in longs),
        step_short_ms=min(d for _, d in shorts), step_long_ms=min(d for _, d in longs), batch=batch,
        batch_step_ms=min(batched), steps=steps,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_agents", description=__doc__.split("\n")[0])
    parser.add_argument("--regime", choices=sorted(REGIMES), default="tiny")
    parser.add_argument("--sessions", type=int, help="default: the regime's")
    parser.add_argument("--rate", type=float, help="session arrivals per trace second")
    parser.add_argument("--time-scale", help="wall seconds per trace second of tools, or auto (see the docstring)")
    parser.add_argument("--blocks", type=int, help=f"vLLM's KV pool, blocks of {BLOCK_SIZE} tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="default: the regime's model under the repository")
    parser.add_argument("--url", help="a running server (with --kv-events, --kv-replay, --control); default: start one")
    parser.add_argument("--kv-events")
    parser.add_argument("--kv-replay")
    parser.add_argument("--control")
    parser.add_argument("--txt", type=Path, help="also write the output here")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(DEFAULT_MODES),
        help=f"run these, in this order (default: {' '.join(DEFAULT_MODES)})",
    )
    args = parser.parse_args(argv)
    regime = REGIMES[args.regime]
    sessions = args.sessions or regime.sessions
    rate = args.rate or regime.rate
    blocks = args.blocks or regime.blocks
    model = args.model or str(repo_root() / regime.model)
    out = Tee(args.txt)

    name, trace = workload(args.regime, sessions, rate, args.seed, regime.max_context)
    contexts = sorted(s.final_context_tokens for s in trace)
    out.print(
        f"{len(trace)} {name} sessions, {sum(len(s.turns) for s in trace)} LLM calls, final contexts "
        f"{contexts[0]}-{contexts[-1]} tokens (cut at {regime.max_context}); "
        f"KV pool {blocks} blocks x {BLOCK_SIZE} tokens ({blocks * BLOCK_SIZE} tokens); model {Path(model).name}"
    )
    server = None
    if args.url:
        endpoints = {"url": args.url, "kv_events": args.kv_events, "kv_replay": args.kv_replay, "control": args.control}
    else:
        run_dir = Path(tempfile.mkdtemp(prefix="agentlog-bench-vllm-"))
        config = VllmServerConfig(
            model=model, run_dir=run_dir, num_gpu_blocks=blocks, block_size=BLOCK_SIZE,
            max_model_len=model_window(model, regime),
            # Requests without a priority (stock vLLM, the manager alone) all get 0: first come first served.
            scheduling_policy="priority" if SCHEDULED & set(args.modes) else "fcfs",
            # vLLM's CPU build keeps one core for its engine-core process and computes on the rest: on
            # 2 cores, half the machine (a 2,048-token prefill of the long model: 18.8 s bound to one
            # core, 8.7-9.5 s unbound). Unbound, the model uses both (vLLM ignores it on a GPU).
            extra_env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
            ranked_pins=bool(RANKED & set(args.modes)),
        )  # fmt: skip
        began = time.monotonic()
        server = VllmServer(config).start()
        out.print(f"vLLM ready in {time.monotonic() - began:.0f} s")
        endpoints = {
            "url": config.url, "kv_events": config.kv_events, "kv_replay": config.kv_replay, "control": config.control
        }  # fmt: skip
    try:
        time_scale_arg = args.time_scale or regime.time_scale
        speeds = asyncio.run(measure_speeds(endpoints["url"], min(4096, regime.max_context // 2)))
        out.print(
            f"measured alone: prefill {speeds.prefill_short_ms / speeds.short:.3f} ms/token at {speeds.short} "
            f"tokens, {speeds.prefill_long_ms / speeds.long:.3f} at {speeds.long}; a decode step "
            f"{speeds.step_short_ms:.1f} ms after {speeds.short}, {speeds.step_long_ms:.1f} after {speeds.long}, "
            f"{speeds.batch_step_ms:.1f} for {speeds.batch} sequences after {speeds.short}"
        )
        if time_scale_arg == "auto":
            measured = speeds.prefill_long_ms / speeds.long
            reference = CostModel(block_size=BLOCK_SIZE).prefill_ms(speeds.long) / speeds.long
            time_scale = measured / reference
            out.print(
                f"prefill here {measured:.3f} ms/token vs the cost model's A100 {reference:.3f}: "
                f"tools x{time_scale:.2f} (--time-scale auto)"
            )
        else:
            time_scale = float(time_scale_arg)
            out.print(f"tools x{time_scale:g}")
        real = {}
        for mode in args.modes:
            began = time.monotonic()
            real[mode] = asyncio.run(run_mode(mode, trace, endpoints, blocks, time_scale))
            out.print(f"{mode}: {time.monotonic() - began:.1f} s")
    finally:
        if server is not None:
            server.stop()
    cost = calibrated(speeds, time_scale)
    out.print(
        f"calibrated cost model (trace ms): prefill {cost.prefill_ms_per_token:.3f}/token "
        f"+ {cost.prefill_attention_ms_per_token_pair:.2e}/pair, decode step {cost.decode_ms_per_token:.2f} "
        f"({cost.decode_ms_per_sequence:.2f} per sequence) + {cost.decode_ms_per_context_token:.2e}/context token"
    )
    modes = tuple(args.modes)
    sim = simulate(trace, blocks, cost, modes)
    print_table(
        {
            "real vLLM": real,
            "sim (A100 model)": simulate(trace, blocks, CostModel(block_size=BLOCK_SIZE), modes),
            "sim (calibrated)": sim,
        },
        out,
    )
    print_prediction(real, sim, time_scale, out)
    out.close()
    return 0


def print_prediction(real: dict[str, ModeResult], sim: dict[str, ModeResult], time_scale: float, out: Tee) -> None:
    """How well the calibrated simulator predicts the real run: its job times in wall seconds
    (trace seconds times the time scale) and each mode's ratio to stock vLLM."""
    out.print("simulator prediction (calibrated, batching engine model) vs the real run:")
    for name in real:
        predicted = sim[name].mean_jct * time_scale
        err = predicted / real[name].mean_jct - 1 if real[name].mean_jct else 0.0
        out.print(f"  {name:12} mean JCT real {real[name].mean_jct:.1f} s, predicted {predicted:.1f} s ({err:+.0%})")
    for name in real:
        if name == "vllm" or "vllm" not in real:
            continue
        real_ratio = real[name].mean_jct / real["vllm"].mean_jct if real["vllm"].mean_jct else 0.0
        sim_ratio = sim[name].mean_jct / sim["vllm"].mean_jct if sim["vllm"].mean_jct else 0.0
        out.print(f"  {name}/vllm mean JCT real {real_ratio:.2f}, predicted {sim_ratio:.2f}")


class Tee:
    """Print to stdout and, with a path, to a file too (bench/results/)."""

    def __init__(self, path: Path | None) -> None:
        self._file = path.open("w") if path is not None else None

    def print(self, *parts: object) -> None:
        print(*parts)
        if self._file is not None:
            print(*parts, file=self._file)

    def write(self, text: str) -> int:
        sys.stdout.write(text)
        if self._file is not None:
            self._file.write(text)
        return len(text)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


if __name__ == "__main__":
    sys.exit(main())
