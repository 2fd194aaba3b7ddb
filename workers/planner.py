"""The planner: hosts agent programs, calls the engine, appends actions.

Reads agent.actions, agent.verdicts, agent.effects and ops.commands; appends
only to agent.actions. For each session of its partitions it asks
``services.planning.next_move`` what to do and does it, appending the events
``services.decide`` says carry the move out: start a requested session, call the
engine (``LLMCallStarted`` before, ``LLMCallCompleted`` after), propose a tool
call, finish or fail. Verdicts and effects are other
roles' work: the planner waits for them in the log.

Each session is driven by at most one task at a time; an event that arrives
while it runs makes it look again when it is done.

The planner also carries out checkpoint, fork, restore and merge
(docs/branches.md; the rules are ``services/checkpoint.py``): it takes
checkpoints (``CheckpointTaken`` plus a snapshot of the folded state in
Postgres when it has a snapshot store), creates forks (``SessionStarted`` with
the parent and ``ForkCreated`` on the new session), adds a fork's parent
history to its state by reading the parent's log up to the cut (or its
snapshot), proposes a restore's compensations and appends ``RestoreApplied`` /
``RestoreRefused``, and reads branches to append ``MergeApplied`` /
``MergeConflict``. Every one of these appends has a deterministic event id, so
after a crash the same move is made again and lands once.

Crash points (workers/crash.py): ``planner.after_llm_started`` (the engine was
not asked yet), ``planner.after_engine`` (the engine answered, the output is
not logged yet), ``planner.after_llm_completed``, ``planner.after_proposed``,
``planner.after_checkpoint``, ``planner.after_compensations`` (proposed, the
restore not applied yet), ``planner.before_restore``, ``planner.before_merge``
(branches read, the merge not appended yet), ``planner.after_branches``, ``planner.after_routed``
(several engines: the route is logged, the call not started yet).

**Program-level scheduling.** With ``--scheduling plas`` every engine request carries the call's
``priority`` (``services.scheduling``: its program's attained service on the critical path, from
the folded log, as a virtual start time on the log's clock; lower is served first), which the
simulated engine and vLLM (``--scheduling-policy priority``) serve by; ``--scheduling programs``
leaves out the attained-service term (programs in the order they started: the ranks a vLLM with
ranked pins needs, ``services.scheduling.PROGRAM_ORDER``). Off by default on vLLM and OpenAI
endpoints: vLLM refuses a non-zero priority unless its server runs with that policy.

**Several engines** (``--engine ID=URL[,size=small|large]`` repeated, or ``AGENTLOG_ENGINES``;
``workers/engines/pool.py``): before each LLM call the planner picks a model size for the step
(``services.routing.choose_size``: what the program declares, an operator's pin, what finished
sessions taught) and an engine (``--router``, default ``locality``: the engine that holds the
session's prefix, a fork's parent's, unless its queue makes recomputing elsewhere cheaper; where
the prefix is comes from the log, the engines' ``kv.events``, every partition, and the cache
manager's ``kv.decisions``: ``workers/cache_view.py``, docs/routing.md), and
appends ``EngineRouted`` before ``LLMCallStarted`` (which names the chosen engine). A call that
cannot reach its engine marks it down for ``--engine-down-s`` and goes to another one (a new
``EngineRouted``, reason ``failover``, same request id), which computes it once; a call resumed
after a crash goes to the engine its last route names, which answers from its record. With one
``--engine-url`` (the default) nothing is routed and nothing of this is appended.

Run: ``python -m workers.planner [--log-url URL] --engine-url http://127.0.0.1:8100
[--checkpoint-every N] [--snapshot-url postgresql://...] [--scheduling plas|programs|off]
[--engine ID=URL ... --router locality|least_loaded|round_robin]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Any

from log import LoggedEvent, SharedLog
from log.snapshots import SnapshotStore
from log.topics import AGENT_GATEWAY, SESSION_TOPICS
from schemas import events as ev
from schemas.events import CheckpointId
from services.checkpoint import (
    after_cut,
    fold_events,
    merge_plan,
    merge_waits,
)
from services.decide import (
    checkpoint_taken,
    decide,
    engine_failed,
    fork_args,
    fork_created,
    llm_completed,
    merge_outcome,
    restore_applied,
)
from services.gateway import adopt
from services.placement import Located, last_call, learn, locate, routed
from services.planning import (
    ApplyRestore,
    CallEngine,
    CutCheckpoint,
    FailSession,
    FinishSession,
    Idle,
    MergeBranches,
    NeedBase,
    ProposeCompensations,
    ProposeTool,
    RefuseRestore,
    StartBranches,
    StartSession,
    WaitFor,
    next_move,
)
from services.programs import Program
from services.programs.base import ModelToolCall
from services.registry import Registry
from services.replay import cut_events
from services.routing import CallRequest, SizeChoice, SizeStats, choose_size, make_router
from services.scheduling import CallPriority, SchedulingConfig, prioritize, program_progress
from services.session import GATEWAY_PROGRAM, SessionState, ToolStatus, step_of
from workers.cache_view import CacheDecisions, KVEvents
from workers.config import SCHEDULING_MODES, log_namespace, scheduling_config, snapshot_url
from workers.crash import crash_point
from workers.engines import Engine, EngineError, EngineUnavailable
from workers.engines.factory import ENGINE_KINDS, create_engine
from workers.engines.pool import EnginePool, parse_engines
from workers.plugins import builtin_registry
from workers.replay import session_at, take_checkpoint
from workers.runtime import SessionWorker

__all__ = ["PlannerWorker"]

_log = logging.getLogger(__name__)

ENGINE_RETRY_S = (0.2, 0.5, 1.0, 2.0, 5.0)


class PlannerWorker(SessionWorker):
    role = "planner"
    # agent.gateway: the gateway's records of external agents' calls, which the planner adopts.
    topics = (*SESSION_TOPICS, AGENT_GATEWAY.name)
    reports_unknown_sessions = True
    reconcile_every_s = 5.0

    def __init__(
        self,
        log: SharedLog,
        *,
        engine: Engine,
        programs: dict[str, Program] | None = None,
        registry: Registry | None = None,
        engine_patience_s: float = 120.0,
        checkpoint_every: int = 0,
        snapshots: SnapshotStore | None = None,
        scheduling: SchedulingConfig | None = None,
        pool: EnginePool | None = None,
        router: str = "locality",
        **kwargs: Any,
    ) -> None:
        super().__init__(log, **kwargs)
        self.engine = engine
        self.pool = pool  # None: the one engine above, nothing routed
        self.router_name = router
        self.router: Any = None
        self.size_stats: Any = None
        self._learned: set[str] = set()  # finished sessions whose calls the size stats have
        self.cache_view: CacheDecisions | None = None
        self.kv_view: KVEvents | None = None
        if pool is not None:
            self.cache_view = CacheDecisions(log)
            self.kv_view = KVEvents(log)
            self.router = make_router(router)
            self.size_stats = SizeStats()
        self.registry = registry or builtin_registry()
        self.programs = programs if programs is not None else self.registry.programs
        self.tools = self.registry.tool_specs
        self.engine_patience_s = engine_patience_s
        self.checkpoint_every = checkpoint_every
        self.snapshots = snapshots
        self.scheduling = scheduling  # None: engine requests carry no priority
        self._driving: dict[str, bool] = {}  # session -> "look again when done"
        self._waiting_on: dict[str, set[str]] = {}  # branch -> sessions whose merge waits for it
        self._forked: set[str] = set()  # fork requests carried out by this process
        self.num_engine_calls = 0

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--engine-url", default=os.environ.get("AGENTLOG_ENGINE_URL", "http://127.0.0.1:8100"), help="engine API"
        )
        parser.add_argument("--engine-id", default="sim-0")
        parser.add_argument(
            "--engine-kind",
            choices=ENGINE_KINDS,
            default=os.environ.get("AGENTLOG_ENGINE_KIND", "sim"),
            help="sim (agentlog's simulated engine), vllm (vLLM's completions API) or openai (chat completions "
            "with function calling: the sim engine, vLLM's OpenAI server, any OpenAI-compatible endpoint; "
            "AGENTLOG_ENGINE_MODEL, AGENTLOG_ENGINE_API_KEY)",
        )
        parser.add_argument(
            "--checkpoint-every",
            type=int,
            default=int(os.environ.get("AGENTLOG_CHECKPOINT_EVERY", "0")),
            help="take a checkpoint at the first step boundary after this many events (0: only on request)",
        )
        parser.add_argument(
            "--snapshot-url",
            default=None,
            help="Postgres for snapshots of checkpoints and partition marks (default: AGENTLOG_SNAPSHOT_URL, "
            "AGENTLOG_LEDGER_URL, AGENTLOG_PG_URL, or the log itself when it is Postgres; none: checkpoints "
            "without snapshots, partitions replayed from offset 0)",
        )
        parser.add_argument(
            "--engine",
            action="append",
            default=None,
            metavar="ID=URL[,size=small|large]",
            help="one of several engines (repeat; default: AGENTLOG_ENGINES, ';'-separated); each LLM call is "
            "routed to one (workers/engines/pool.py). Without any, --engine-url is the only engine",
        )
        parser.add_argument(
            "--router",
            choices=("locality", "least_loaded", "round_robin"),
            default=os.environ.get("AGENTLOG_ROUTER", "locality"),
            help="how calls are routed between several engines (services.routing)",
        )
        parser.add_argument(
            "--engine-down-s",
            type=float,
            default=float(os.environ.get("AGENTLOG_ENGINE_DOWN_S", "10")),
            help="how long an engine that could not be reached is left out of routing",
        )
        parser.add_argument(
            "--scheduling",
            choices=SCHEDULING_MODES,
            default=None,
            help="plas: send each call's program-level priority (services.scheduling); programs: the same "
            "without the attained-service term (for vLLM with --ranked-pins); off: none (default: "
            "AGENTLOG_SCHEDULING, else plas on the sim engine and off on vllm/openai)",
        )

    @classmethod
    async def create(cls, log: SharedLog, args: argparse.Namespace) -> PlannerWorker:
        pool = None
        specs = parse_engines(args.engine or os.environ.get("AGENTLOG_ENGINES", ""))
        if specs:
            pool = EnginePool.create(specs, kind=args.engine_kind)
            pool.down_s = args.engine_down_s
            engine = pool.client(specs[0].engine_id)
        else:
            engine = create_engine(args.engine_url, engine_id=args.engine_id, kind=args.engine_kind)
        snapshots = None
        if url := snapshot_url(args.snapshot_url, args.log_url):
            snapshots = await SnapshotStore(url, log_namespace(log)).start()
        return cls(
            log,
            group=args.group,
            instance_id=args.instance_id,
            engine=engine,
            checkpoint_every=args.checkpoint_every,
            snapshots=snapshots,
            registry=args.registry,
            scheduling=scheduling_config(args.scheduling, default="plas" if args.engine_kind == "sim" else "off"),
            pool=pool,
            router=args.router,
        )

    async def prepare(self) -> None:
        """Start reading the engines' kv.events (in the background: ``KVEvents``), so that the view
        has caught up by the time the first session has a prefix to route by."""
        await super().prepare()
        if self.kv_view is not None:
            await self.kv_view.refresh()

    async def close(self) -> None:
        if self.kv_view is not None:
            await self.kv_view.aclose()
        if self.pool is not None:
            await self.pool.close()
        else:
            await self.engine.close()
        if self.snapshots is not None:
            await self.snapshots.close()

    async def resume(self, state: SessionState) -> None:
        self._learn(state)
        self.kick(state.session_id)

    async def on_event(self, state: SessionState, event: LoggedEvent) -> None:
        self._learn(state)
        self.kick(state.session_id)
        if isinstance(event.body, _BRANCH_NEWS):
            for parent in self._waiting_on.get(state.session_id, set()):
                self.kick(parent)  # a merge waiting on this branch may go on now

    async def reconcile(self, state: SessionState) -> None:
        self.kick(state.session_id)  # a no-op when it is being driven; cheap when it only waits

    async def on_partition_lost(self, partition: int) -> None:
        for session_id in [s for s in self._driving if self.log.partition_for(s) == partition]:
            self._driving[session_id] = False  # its task stops at the next step (state is gone)

    def kick(self, session_id: str) -> None:
        """Make sure the session is being driven (and looks at its latest state)."""
        if session_id in self._driving:
            self._driving[session_id] = True
            return
        self._driving[session_id] = False
        self.spawn(self._drive(session_id))

    async def _drive(self, session_id: str) -> None:
        try:
            while True:
                state = self.sessions.get(session_id)
                if state is None:
                    return  # the partition moved to another planner
                self._driving[session_id] = False
                if await self._step(state):
                    continue
                if not self._driving.get(session_id):
                    return
        finally:
            self._driving.pop(session_id, None)

    async def _step(self, state: SessionState) -> bool:
        """Carry out one move; True when there may be another one right away."""
        if state.program == GATEWAY_PROGRAM:
            # An external agent's session: no program here, only the gateway's records to adopt.
            await self.append_all(adopt(state, self.tools))
            return False
        await self._fork_requests(state)
        program = self.programs.get(state.program)
        move = next_move(state, program, checkpoint_every=self.checkpoint_every, tools=self.tools)
        sid = state.session_id
        match move:
            case Idle() | WaitFor():
                return False
            case NeedBase():
                await self._inherit(state)
            case CutCheckpoint():
                await self._checkpoint(state, move)
            case ProposeCompensations():
                await self.append_all(decide(state, move, engine_id=self.engine.engine_id, tools=self.tools))
                crash_point("planner.after_compensations")
            case ApplyRestore():
                crash_point("planner.before_restore")
                checkpoint = state.checkpoints[move.plan.checkpoint_id]
                history = await self.log.history(sid)
                num_abandoned = len(after_cut(cut_events(history), checkpoint.taken.cut))
                await self.append_all([restore_applied(state, move, num_abandoned)])
                _log.info("session %s restored to %s", sid, move.plan.checkpoint_id)
            case MergeBranches():
                return await self._merge(state, move.branch_session_ids, cause=move.cause, key=move.cause or "")
            case StartBranches():
                checkpoint = state.checkpoints[move.call_id]
                for branch_id, args_json in move.branches:
                    await self._create_fork(state, branch_id, move.call_id, checkpoint.taken.cut, args_json)
                crash_point("planner.after_branches")
                return await self._merge(state, tuple(b for b, _ in move.branches), cause=None, key=move.call_id)
            case CallEngine():
                await self._call_engine(state, move)
            case ProposeTool():
                await self.append_all(decide(state, move, engine_id=self.engine.engine_id, tools=self.tools))
                crash_point("planner.after_proposed")
            case FailSession():
                _log.warning("session %s fails: %s (%s)", sid, move.reason, move.error_type)
                await self.append_all(decide(state, move, engine_id=self.engine.engine_id, tools=self.tools))
            case StartSession() | RefuseRestore() | FinishSession():
                await self.append_all(decide(state, move, engine_id=self.engine.engine_id, tools=self.tools))
        self._learn(state)
        return True

    # ------------------------------------------------- checkpoint, fork, merge

    async def _checkpoint(self, state: SessionState, move: CutCheckpoint) -> None:
        """Cut the session's log here, fold it, store a snapshot, append CheckpointTaken."""
        body = await take_checkpoint(self.log, self.snapshots, state.session_id, move.checkpoint_id)
        await self.append_all([checkpoint_taken(state, move, body)])
        crash_point("planner.after_checkpoint")

    async def _inherit(self, state: SessionState) -> None:
        assert state.fork is not None
        fork = state.fork
        base = await session_at(self.log, self.snapshots, fork.parent_session_id, fork.checkpoint_id, fork.cut)
        state.inherit(base)
        _log.info(
            "fork %s inherits %d steps of %s up to %s",
            state.session_id,
            base.num_steps,
            state.fork.parent_session_id,
            state.fork.checkpoint_id,
        )

    async def _fork_requests(self, state: SessionState) -> None:
        """Carry out operators' fork requests whose checkpoint this planner has seen (idempotent)."""
        for request_id, request in state.fork_requests:
            if request_id in self._forked:
                continue
            checkpoint = state.checkpoints.get(request.checkpoint_id)
            if checkpoint is None:
                continue  # the checkpoint may still be on its way (another topic); looked at again later
            await self._create_fork(
                state,
                request.fork_session_id,
                CheckpointId(request.checkpoint_id),
                checkpoint.taken.cut,
                fork_args(state),
            )
            self._forked.add(request_id)

    async def _create_fork(
        self, parent: SessionState, fork_id: str, checkpoint_id: CheckpointId, cut: dict[str, int], args_json: str
    ) -> None:
        await self.append_all(
            fork_created(parent, fork_id, checkpoint_id, cut, args_json), for_session=parent.session_id
        )
        if self.log.partition_for(fork_id) in self._ready:
            self.kick(fork_id)  # our own appends are not read back as news: start it ourselves
        else:
            self.sessions.pop(fork_id, None)  # another planner's session: it reads it from the log

    async def _merge(self, state: SessionState, branch_ids: tuple[str, ...], *, cause: str | None, key: str) -> bool:
        sid = state.session_id
        branches = {b: fold_events(b, cut_events(await self.log.history(b))) for b in branch_ids}
        plan = merge_plan(branches, sid, await self._merge_waiters(branches))
        outcome = merge_outcome(state, branch_ids, plan, cause=cause, key=key)
        if outcome is None:
            for branch in plan.waiting_for:
                self._waiting_on.setdefault(branch, set()).add(sid)
            return False
        for branch in branch_ids:
            self._waiting_on.get(branch, set()).discard(sid)
        crash_point("planner.before_merge")
        if plan.conflicted:
            _log.warning("merge into %s conflicts: %s", sid, "; ".join(plan.conflicts))
        await self.append_all([outcome])
        return True

    async def _merge_waiters(self, branches: dict[str, SessionState], limit: int = 64) -> dict[str, SessionState]:
        """The sessions the branches wait to merge, and whom those wait for, and so on (at most
        ``limit``): what ``merge_plan`` needs to see a merge cycle."""
        others: dict[str, SessionState] = {}
        todo = [s for s in branches.values() if not s.finished]
        while todo and len(others) < limit:
            named, _prefixes = merge_waits(todo.pop())
            for sid in sorted(named - others.keys() - branches.keys()):
                state = others[sid] = fold_events(sid, cut_events(await self.log.history(sid)))
                if not state.finished:
                    todo.append(state)
        return others

    async def _call_engine(self, state: SessionState, move: CallEngine) -> None:
        sid = state.session_id
        if self.pool is not None:
            await self._call_routed(state, move)
            return
        if not move.resume:
            # Ranked before the start is logged, so that LLMCallStarted records what the request carries.
            ranked = await self.prioritize(state)
            appends = decide(state, move, engine_id=self.engine.engine_id, tools=self.tools, priority=ranked)
            await self.append_all(appends)
            crash_point("planner.after_llm_started")
            priority = None if ranked is None else ranked.priority
        else:
            priority = await self._recorded_priority(state, move)
        try:
            completion = await self._complete(sid, move, priority)
        except EngineError as e:
            await self.append_all([engine_failed(state, str(e))])
            return
        await self._completed(state, move, completion)

    async def _completed(self, state: SessionState, move: CallEngine, completion: Any) -> None:
        crash_point("planner.after_engine")
        self.num_engine_calls += 1
        completed = ev.LLMCallCompleted(
            call_id=move.call_id,
            engine_id=completion.engine_id,
            prompt_tokens=completion.prompt_tokens,
            cached_tokens=completion.cached_tokens,
            output_tokens=completion.output_tokens,
            output_text=completion.text,
            finish_reason=completion.finish_reason,
            queue_ms=completion.queue_ms,
            prefill_ms=completion.prefill_ms,
            decode_ms=completion.decode_ms,
            tool_calls_json=ModelToolCall.list_to_json(completion.tool_calls),
        )
        await self.append_all([llm_completed(state, move, completed)])
        crash_point("planner.after_llm_completed")

    # ------------------------------------------------------------ several engines

    async def _call_routed(self, state: SessionState, move: CallEngine) -> None:
        """Route the call (or take its recorded route), then ask that engine; fail over to another
        one when it cannot be reached (module docstring)."""
        pool = self.pool
        assert pool is not None
        sid = state.session_id
        loop = asyncio.get_running_loop()
        route = state.routes.get(move.call_id)
        if route is None and move.resume and pool.knows(engine := state.llm_calls[move.call_id].started.engine_id):
            engine_id, attempt = engine, -1  # started before it was routed: its engine answers from its record
        else:
            if route is None:
                route = await self._route(state, move, attempt=0)
            engine_id, attempt = route.engine_id, route.attempt
        if not move.resume:
            ranked = await self.prioritize(state)
            appends = decide(state, move, engine_id=ev.EngineId(engine_id), tools=self.tools, priority=ranked)
            await self.append_all(appends)
            crash_point("planner.after_llm_started")
            priority = None if ranked is None else ranked.priority
        else:
            priority = await self._recorded_priority(state, move)
        deadline = loop.time() + self.engine_patience_s
        waits = 0
        while True:
            if not pool.knows(engine_id):  # a route recorded by a planner with other engines
                route = await self._route(state, move, attempt=attempt + 1, failed=engine_id, keep=route)
                engine_id, attempt = route.engine_id, route.attempt
                continue
            # An engine's queue, as far as this planner knows: the prompt tokens its calls in flight
            # there must compute (what the router expected; all of them for a call it did not route).
            asked, tokens = engine_id, route.expected_recompute_tokens if route is not None else move.prompt.num_tokens
            pool.begin(asked, tokens)
            try:
                completion = await self._ask(pool.client(asked), sid, move, priority)
            except EngineUnavailable as e:
                now = loop.time()
                pool.mark_down(asked, now)
                if any(i.healthy for i in pool.infos(now, exclude=[asked])):
                    _log.warning("engine %s unavailable (%s); %s fails over", asked, e, move.request_id)
                    route = await self._route(state, move, attempt=attempt + 1, failed=asked, keep=route)
                    engine_id, attempt = route.engine_id, route.attempt
                    continue
                if now >= deadline:
                    reason = f"no engine reachable for {self.engine_patience_s:g} s: {e}"
                    await self.append_all([engine_failed(state, reason)])
                    return
                delay = ENGINE_RETRY_S[min(waits, len(ENGINE_RETRY_S) - 1)]
                _log.warning("no engine reachable (%s); retrying %s in %.1f s", e, move.request_id, delay)
                await asyncio.sleep(delay)
                waits += 1
                continue
            except EngineError as e:
                await self.append_all([engine_failed(state, str(e))])
                return
            finally:
                pool.end(asked, tokens)
            pool.mark_up(asked)
            await self._completed(state, move, completion)
            return

    async def _route(
        self,
        state: SessionState,
        move: CallEngine,
        *,
        attempt: int,
        failed: str | None = None,
        keep: ev.EngineRouted | None = None,
    ) -> ev.EngineRouted:
        """Choose the size (a failover keeps ``keep``'s) and the engine; append ``EngineRouted``."""
        pool = self.pool
        assert pool is not None
        now = asyncio.get_running_loop().time()
        sid = state.session_id
        if keep is not None:
            choice = SizeChoice(keep.model_size, keep.size_reason)
        else:
            program = self.programs.get(state.program)
            choice = choose_size(
                state.program,
                str(step_of(move.call_id)),
                declared=move.size or getattr(program, "model_size", None),
                pinned=state.model_pin,
                stats=self.size_stats,
                retry=_after_failed_tool(state, move.call_id),
                available=pool.sizes(now),
            )
        located = await self._locate(state)
        cached = located.cached
        call = CallRequest(
            sid, move.prompt.num_tokens, cached, parent_session_id=state.parent_session_id, size=choice.size
        )
        chosen, failed = pool.choose(self.router, call, now, failed=failed)
        body = routed(
            call_id=move.call_id,
            request_id=move.request_id,
            attempt=attempt,
            route=chosen,
            router=self.router_name,
            prompt_tokens=move.prompt.num_tokens,
            cached=cached,
            size=choice,
            failed_engine_id=failed,
            reason="failover" if failed else None,
            notes=located.notes,
        )
        await self.append(sid, body, kind="routed", key=f"{move.call_id}/{attempt}")
        crash_point("planner.after_routed")
        return body

    async def _locate(self, state: SessionState) -> Located:
        """Where the session's prefix is (``services.placement.locate``): its last call's engine,
        what the engines' ``kv.events`` say each still holds of it, and the engines where the cache
        manager discarded it since (a fork's inherited call: its parent's events and decisions)."""
        call = last_call(state)
        assert self.pool is not None
        if self.kv_view is not None:
            await self.kv_view.refresh()
        if call is None or call.completed is None:
            return Located({})
        owner = call.origin or state.session_id
        engine_ids = [s.engine_id for s in self.pool.specs]
        holdings = {} if self.kv_view is None else self.kv_view.holding(owner, engine_ids)
        dropped = (
            [] if self.cache_view is None else await self.cache_view.dropped_on(owner, engine_ids, call.completed_at)
        )
        return locate(state, dropped, holdings)

    def _learn(self, state: SessionState) -> None:
        """A finished session's routed calls teach the size stats (once per session)."""
        if self.size_stats is None or not state.finished or state.session_id in self._learned:
            return
        self._learned.add(state.session_id)
        learn(state, self.size_stats.record)

    async def priority(self, state: SessionState) -> int | None:
        """The priority of the session's next call: now on the log's clock, placed by its program's
        progress on the critical path (its branches: the sessions this planner holds), ahead by the
        warm credit while the cache manager preserves its KV."""
        ranked = await self.prioritize(state)
        return None if ranked is None else ranked.priority

    async def prioritize(self, state: SessionState) -> CallPriority | None:
        """``priority`` with what it was computed from (recorded on ``LLMCallStarted``)."""
        if self.scheduling is None:
            return None
        if self.cache_view is None:  # the warm credit reads kv.decisions as routing does
            self.cache_view = CacheDecisions(self.log)
        await self.cache_view.refresh(self.log.partition_for(state.session_id))
        now = self.log.clock().timestamp()
        warm = self.cache_view.preserved(state.session_id, now)
        return prioritize(now, program_progress(state, self.sessions), warm=warm, config=self.scheduling)

    async def _recorded_priority(self, state: SessionState, move: CallEngine) -> int | None:
        """A resumed call's priority (its LLMCallStarted is in the log, the engine may not have been
        asked): the one recorded, so that the call keeps its place after a crash; a record without
        one (scheduling was off, or written before release 8) is ranked now."""
        call = state.llm_calls.get(move.call_id)
        if call is not None and call.started.priority is not None and self.scheduling is not None:
            return call.started.priority
        return await self.priority(state)

    async def _ask(self, engine: Engine, session_id: str, move: CallEngine, priority: int | None) -> Any:
        return await engine.complete(
            session_id=session_id,
            request_id=move.request_id,
            prompt=move.prompt,
            max_output_tokens=move.max_output_tokens,
            messages=move.messages,
            tools=move.tools,
            tool_choice=move.tool_choice,
            priority=priority,
        )

    async def _complete(self, session_id: str, move: CallEngine, priority: int | None = None) -> Any:
        """Ask the engine, retrying while it is unreachable (it may be restarting); every retry
        carries the same priority (the call's, fixed when it was first asked)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.engine_patience_s
        attempt = 0
        while True:
            try:
                return await self._ask(self.engine, session_id, move, priority)
            except EngineUnavailable as e:
                if loop.time() >= deadline:
                    raise EngineError(f"engine unavailable for {self.engine_patience_s:g} s: {e}") from e
                delay = ENGINE_RETRY_S[min(attempt, len(ENGINE_RETRY_S) - 1)]
                _log.warning("engine unavailable (%s); retrying %s in %.1f s", e, move.request_id, delay)
                await asyncio.sleep(delay)
                attempt += 1


def _after_failed_tool(state: SessionState, call_id: str) -> bool:
    """Whether this LLM call retries what the small model got wrong: the step before it is a tool
    call that failed or was aborted, proposed by an LLM call the small model served
    (``choose_size``'s ``retry``)."""
    step = step_of(call_id)
    failed = [
        t
        for t in state.tool_calls.values()
        if step_of(t.call_id) == step - 1 and t.status in (ToolStatus.FAILED, ToolStatus.ABORTED)
    ]
    if not failed:
        return False
    earlier = [c for c in state.llm_calls.values() if step_of(c.call_id) < step - 1]
    proposer = max(earlier, key=lambda c: step_of(c.call_id), default=None)
    route = state.routes.get(proposer.call_id) if proposer is not None else None
    return route is not None and route.model_size == "small"


_BRANCH_NEWS = (ev.SessionFinished, ev.SessionFailed, ev.ToolCallInDoubt, ev.ToolCallStarted)


if __name__ == "__main__":
    from workers.main import run_worker

    run_worker(PlannerWorker)
