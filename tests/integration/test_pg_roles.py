"""The roles on the Postgres backend: each principal inserts only into its own topics; nobody rewrites history."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import asyncpg
import pytest

from log import NotTopicOwner, SharedLog
from log.acls import ROLES
from log.pg_roles import apply_roles, dsn_for, role_name
from log.postgres_backend import PostgresBackend, table_name
from log.topics import TOPICS
from schemas.events import SessionStarted, ToolCallCompleted

pytestmark = pytest.mark.integration

PASSWORDS = {role.principal: secrets.token_urlsafe(12) for role in ROLES}


async def setup(pg_url: str, namespace: str) -> None:
    admin = PostgresBackend(pg_url, namespace=namespace)
    await admin.start()
    await admin.create_topics(2)
    await admin.close()
    await apply_roles(pg_url, namespace, PASSWORDS)


async def try_sql(dsn: str, namespace: str, sql: str, *args: Any) -> str:
    """``ok`` or the Postgres error class name."""
    conn = await asyncpg.connect(dsn, server_settings={"search_path": f'"{namespace}"'})
    try:
        await conn.execute(sql, *args)
        return "ok"
    except asyncpg.PostgresError as e:
        return type(e).__name__
    finally:
        await conn.close()


def test_each_role_inserts_only_into_its_own_topics(pg_url: str, namespace: str) -> None:
    async def scenario() -> dict[tuple[str, str], str]:
        await setup(pg_url, namespace)
        outcomes = {}
        for n, role in enumerate(ROLES):
            dsn = dsn_for(pg_url, role.principal, PASSWORDS[role.principal])
            for topic in TOPICS:
                sql = (
                    f"INSERT INTO {table_name(topic.name)} (partition, record_offset, record_key, value) "
                    "VALUES (0, 1000000 + $1, 'k', 'v')"
                )
                # A distinct offset per role: several roles may write the DLQ.
                outcomes[(role.principal, topic.name)] = await try_sql(dsn, namespace, sql, n)
        return outcomes

    outcomes = asyncio.run(scenario())
    for (principal, topic), outcome in outcomes.items():
        role = next(r for r in ROLES if r.principal == principal)
        expected = "ok" if topic in role.writes else "InsufficientPrivilegeError"
        assert outcome == expected, (principal, topic, outcome)
    assert outcomes[("planner", "agent.effects")] == "InsufficientPrivilegeError"
    assert outcomes[("executor", "agent.verdicts")] == "InsufficientPrivilegeError"
    assert outcomes[("decider", "agent.effects")] == "InsufficientPrivilegeError"
    assert {o for (p, _), o in outcomes.items() if p == "auditor"} == {"InsufficientPrivilegeError"}


def test_nobody_updates_or_deletes_the_log(pg_url: str, namespace: str) -> None:
    async def scenario() -> list[tuple[str, str, str]]:
        await setup(pg_url, namespace)
        async with SharedLog(PostgresBackend(pg_url, namespace=namespace), actor="planner") as log:
            await log.append("s", SessionStarted(program="p", args_json="{}"))
        table = table_name("agent.actions")
        results = []
        for principal in ("planner", "auditor", "operator"):
            dsn = dsn_for(pg_url, principal, PASSWORDS[principal])
            for sql in (f"UPDATE {table} SET value = 'x'", f"DELETE FROM {table}", f"TRUNCATE {table}"):
                results.append((principal, sql.split()[0], await try_sql(dsn, namespace, sql)))
        # Even the owner of the tables (the admin) is stopped by the trigger.
        for sql in (f"UPDATE {table} SET value = 'x'", f"DELETE FROM {table}", f"TRUNCATE {table}"):
            results.append(("admin", sql.split()[0], await try_sql(pg_url, namespace, sql)))
        return results

    results = asyncio.run(scenario())
    assert all(outcome == "InsufficientPrivilegeError" for _, _, outcome in results), results


def test_a_role_works_through_the_shared_log_and_only_in_its_own_group(pg_url: str, namespace: str) -> None:
    async def scenario() -> None:
        await setup(pg_url, namespace)
        planner_dsn = dsn_for(pg_url, "planner", PASSWORDS["planner"])
        async with SharedLog(PostgresBackend(planner_dsn, namespace=namespace), actor="planner") as log:
            await log.append("s", SessionStarted(program="p", args_json="{}"))
            async with log.consumer("planner", ["agent.actions"], from_beginning=True) as consumer:
                events = []
                for _ in range(10):
                    events += await consumer.poll(timeout_s=0.2)
                    if events:
                        break
                assert [e.seq for e in events] == [0]
                await consumer.commit()
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await log.consumer("executor", ["agent.actions"]).start()
            with pytest.raises(NotTopicOwner):
                await log.append("s", ToolCallCompleted(call_id="t", result_json="{}", result_tokens=0, duration_ms=0))

    asyncio.run(scenario())
    assert role_name("cache-manager") == "agentlog_cache_manager"
