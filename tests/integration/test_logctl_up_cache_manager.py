"""``logctl up --cache-manager``: the whole stack with the engine bridge and the cache manager,
on the embedded Postgres log, then a clean Ctrl-C."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.common import ensure_topics
from cli.main import app
from log import open_log
from schemas import events as ev
from tests.logctl_up import logctl_up

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = {
    "steps": [
        {"llm": {"prompt_tokens": 96, "output_tokens": 8}},
        {"tool": "sleep", "arguments": {"seconds": 2}},
        {"llm": {"prompt_tokens": 16, "output_tokens": 4}},
    ]
}


async def _kv_counts(pg_url: str, namespace: str) -> tuple[int, int]:
    async with open_log(pg_url, actor="auditor", namespace=namespace) as log:
        events = decisions = 0
        for topic in ("kv.events", "kv.decisions"):
            for partition, end in (await log.end_offsets(topic)).items():
                async for record in log.scan(topic, partition, 0, end):
                    body = log.decode(record).body
                    events += isinstance(body, ev.KVBlocksStored)
                    decisions += isinstance(body, ev.CacheDecisionMade)
        return events, decisions


def test_up_with_the_cache_manager_runs_sessions_and_stops_cleanly(pg_url: str, namespace: str, tmp_path: Path) -> None:
    env = {**os.environ, "AGENTLOG_NAMESPACE": namespace, "AGENTLOG_LEDGER_URL": pg_url}
    ensure_topics(pg_url, namespace=namespace)
    flags = ["--time-scale", "0.05", "--work-dir", str(tmp_path), "--cache-manager", "--gpu-blocks", "256",
             "--host-blocks", "64"]  # fmt: skip
    # Leaving the block stops the stack with SIGTERM (a process manager's stop, not only Ctrl-C),
    # which must drain every process.
    with logctl_up(pg_url, *flags, env=env) as stack:
        assert {"engine-bridge", "cache-manager", "planner-0", "decider", "executor"} <= stack.names

        ran = CliRunner().invoke(
            app,
            ["run", "script", "--log-url", pg_url, "-n", "3", "--args", json.dumps(STEPS), "--json"],
            env={"AGENTLOG_NAMESPACE": namespace},
        )
        assert ran.exit_code == 0, ran.output
        assert json.loads(ran.output.strip().splitlines()[-1])["finished"] == 3

        # The bridge carried the engine's KV events into the log, and the cache manager decided
        # on the tool gaps and the ends (it may trail the sessions by a poll or two).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            counts = asyncio.run(_kv_counts(pg_url, namespace))
            if counts[0] >= 6 and counts[1] >= 3:
                break
            time.sleep(0.5)
        events, decisions = counts
        assert events >= 6 and decisions >= 3, counts
