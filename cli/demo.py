"""``logctl demo``: the shared log at work, on the embedded default.

Each role writes through its own SharedLog (its own principal): the planner
proposes, the decider commits, the executor runs, the engine bridge reports KV
blocks. A consumer reads everything back verified, one forged record goes to
the dead-letter topic, and a summary says what happened.
"""

from __future__ import annotations

import json
import time
import uuid

import typer

from log import SharedLog, open_log
from log.backend import OutRecord
from schemas.events import (
    EffectClass,
    KVBlocksStored,
    KVTier,
    LLMCallCompleted,
    LLMCallStarted,
    SessionFinished,
    SessionStarted,
    ToolCallCommitted,
    ToolCallCompleted,
    ToolCallProposed,
    ToolCallStarted,
    Vote,
    VoteDecision,
)


async def run_demo(log_url: str | None, num_sessions: int, turns: int) -> dict[str, object]:
    run_id = uuid.uuid4().hex[:6]
    roles = ("admin", "planner", "decider", "executor", "engine-bridge", "auditor")
    logs: dict[str, SharedLog] = {role: open_log(log_url, actor=role) for role in roles}
    await logs["admin"].backend.start()
    await logs["admin"].backend.create_topics(4)
    for log in logs.values():
        await log.start()
    planner, decider, executor, bridge = (logs[r] for r in ("planner", "decider", "executor", "engine-bridge"))
    started = time.perf_counter()
    sessions = [f"demo-{run_id}-{i:02d}" for i in range(num_sessions)]
    for session in sessions:
        await planner.append(session, SessionStarted(program="demo", args_json=json.dumps({"turns": turns})))
        for turn in range(turns):
            call = f"llm-{turn}"
            await planner.append(
                session,
                LLMCallStarted(
                    call_id=call,
                    turn=turn,
                    engine_id="sim-0",
                    prompt_tokens=512 * (turn + 1),
                    max_output_tokens=128,
                    prompt_digest=f"{turn:064x}",
                ),
            )
            await bridge.append(
                session,
                KVBlocksStored(
                    engine_id="sim-0",
                    block_hashes=[f"{session}:{turn}:{b}" for b in range(4)],
                    num_tokens=512,
                    block_size=16,
                    tier=KVTier.GPU,
                ),
            )
            await planner.append(
                session,
                LLMCallCompleted(
                    call_id=call,
                    engine_id="sim-0",
                    prompt_tokens=512 * (turn + 1),
                    cached_tokens=512 * turn,
                    output_tokens=64,
                    output_text="{}",
                    finish_reason="stop",
                    queue_ms=0.0,
                    prefill_ms=5.0,
                    decode_ms=20.0,
                ),
            )
            tool = f"tool-{turn}"
            await planner.append(
                session,
                ToolCallProposed(
                    call_id=tool,
                    tool="echo",
                    arguments_json="{}",
                    effect_class=EffectClass.PURE,
                    idempotency_key=f"{session}/{tool}",
                ),
            )
            vote = Vote(voter="allow_list", decision=VoteDecision.APPROVE, reason="echo is allowed")
            await decider.append(session, ToolCallCommitted(call_id=tool, votes=[vote], policy="unanimous"))
            await executor.append(session, ToolCallStarted(call_id=tool, tool="echo", idempotency_key=tool, attempt=1))
            await executor.append(
                session, ToolCallCompleted(call_id=tool, result_json="{}", result_tokens=32, duration_ms=1.0)
            )
        await planner.append(session, SessionFinished(output_json="{}", num_llm_calls=turns, num_tool_calls=turns))
    wrote_s = time.perf_counter() - started
    # A forger with raw access writes a record claiming to be the executor onto agent.actions.
    forged_session = sessions[0]
    forged, _ = planner.codec.encode(
        event_id=str(uuid.uuid4()),
        session_id=forged_session,
        seq=999,
        actor="executor",
        occurred_at=planner.clock(),
        causation_id=None,
        prev_hash=bytes(32),
        body=SessionFinished(output_json='{"forged": true}', num_llm_calls=0, num_tool_calls=0),
    )
    await (
        await planner.backend.produce(
            "agent.actions", [OutRecord(planner.partition_for(forged_session), forged_session.encode(), forged)]
        )
    )
    auditor = logs["auditor"]
    num_events = 0
    async with auditor.consumer(
        f"demo-{run_id}", ["agent.actions", "agent.verdicts", "agent.effects", "kv.events"], from_beginning=True
    ) as consumer:
        idle = 0
        while idle < 3:
            events = await consumer.poll(timeout_s=0.5, max_records=2000)
            mine = [e for e in events if e.session_id.startswith(f"demo-{run_id}")]
            num_events += len(mine)
            idle = 0 if events else idle + 1
        await consumer.commit()
        dead = dict(consumer.stats.dead_lettered_by_error)
    history = await auditor.history(sessions[0])
    for log in logs.values():
        await log.close()
    return {
        "sessions": num_sessions,
        "events_written": num_sessions * (2 + 7 * turns),
        "events_read_verified": num_events,
        "dead_lettered": dead,
        "first_session": sessions[0],
        "first_session_events": len(history),
        "write_seconds": round(wrote_s, 2),
    }


def print_summary(result: dict[str, object]) -> None:
    typer.echo("")
    typer.echo(f"sessions              {result['sessions']}")
    typer.echo(f"events written        {result['events_written']}  ({result['write_seconds']} s, five principals)")
    typer.echo(f"events read, verified {result['events_read_verified']}")
    typer.echo(f"sent to agent.dlq     {result['dead_lettered']}  (a forged record; this run's and earlier runs')")
    typer.echo(f"history of {result['first_session']}: {result['first_session_events']} events across topics")
    typer.echo("")
    typer.echo("Look around:")
    typer.echo("  logctl tail --from-beginning --idle-exit 2            # every topic, one line per event")
    typer.echo("  logctl tail --topic agent.dlq --from-beginning --idle-exit 2 --json")
