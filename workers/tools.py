"""Tool implementations: the code that touches the world.

Every tool gets its arguments and a ``ToolContext`` (the session, the call,
the idempotency key, the sandbox and the ledger) and returns ``(result,
result_tokens)``; it raises to fail. Specs (effect classes, argument schemas)
are in ``services/tools.py``.

The ledger is a Postgres schema ``agentlog_ledger`` with one table per kind of
external effect. ``payments`` deliberately has no unique constraint on the
idempotency key: it records every execution, so a duplicate would be visible
(the recovery tests count them).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg

from services.registry import OutcomeUnknown, Tool, ToolOutput, ToolUnavailable
from services.tools import TOOLS

if TYPE_CHECKING:
    from workers.resources import ToolResources

LEDGER_DDL = """
CREATE SCHEMA IF NOT EXISTS agentlog_ledger;
CREATE TABLE IF NOT EXISTS agentlog_ledger.payments (
    id bigserial PRIMARY KEY, idempotency_key text NOT NULL, session_id text NOT NULL, call_id text NOT NULL,
    account text NOT NULL, amount_cents bigint NOT NULL, executed_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS agentlog_ledger.bookings (
    id bigserial PRIMARY KEY, idempotency_key text NOT NULL, session_id text NOT NULL, call_id text NOT NULL,
    resource text NOT NULL, nights int NOT NULL, status text NOT NULL, executed_at timestamptz NOT NULL DEFAULT now());
"""


class Ledger:
    """The record of external effects (payments, bookings) in Postgres."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._pool: asyncpg.Pool | None = None

    async def start(self) -> Ledger:
        self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=2)
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('agentlog:ledger'))")
            await conn.execute(LEDGER_DDL)
        return self

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("ledger not started")
        return self._pool

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None


@dataclass(frozen=True)
class ToolContext:
    session_id: str
    call_id: str
    idempotency_key: str
    sandbox: Path
    ledger: Ledger | None
    time_scale: float = 1.0
    """Multiplies every wait (sleep, trace_tool): 0.01 runs a 60 s tool in 0.6 s."""
    resources: ToolResources | None = None
    """What the tool may acquire, owned by its session (workers/resources.py); None outside an executor."""


ToolFn = Callable[[dict[str, Any], ToolContext], Awaitable[tuple[Any, int]]]


def _ledger(ctx: ToolContext, tool: str) -> Ledger:
    if ctx.ledger is None:
        raise RuntimeError(f"{tool} needs the ledger (executor --ledger-url)")
    return ctx.ledger


def _tokens(text: str) -> int:
    return max(1, len(text) // 4)


async def sleep(args: dict[str, Any], ctx: ToolContext) -> tuple[Any, int]:
    await asyncio.sleep(float(args["seconds"]) * ctx.time_scale)
    return {"slept_s": args["seconds"]}, 4


async def echo(args: dict[str, Any], ctx: ToolContext) -> tuple[Any, int]:
    return {"text": args["text"]}, _tokens(args["text"])


async def trace_tool(args: dict[str, Any], ctx: ToolContext) -> tuple[Any, int]:
    await asyncio.sleep(float(args["duration_s"]) * ctx.time_scale)
    return {"tool": args["tool"], "result_tokens": args["result_tokens"]}, int(args["result_tokens"])


async def file_write(args: dict[str, Any], ctx: ToolContext) -> tuple[Any, int]:
    target = (ctx.sandbox / args["path"]).resolve()
    if not target.is_relative_to(ctx.sandbox.resolve()):
        raise PermissionError(f"{args['path']} is outside the sandbox")
    marker = ctx.sandbox / ".done" / ctx.idempotency_key.replace("/", "_")
    if marker.exists():  # this key already wrote it: a retry is the same effect
        return {"path": args["path"], "bytes": len(args["content"]), "already_written": True}, 8
    target.parent.mkdir(parents=True, exist_ok=True)
    marker.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=target.parent, delete=False) as tmp:
        tmp.write(args["content"])
    os.replace(tmp.name, target)  # atomic: readers see the old or the new file, never half
    marker.write_text(json.dumps({"path": args["path"]}))
    return {"path": args["path"], "bytes": len(args["content"])}, 8


# What a lost or refused connection raises: the server is down, restarting, shutting down
# (class 57, operator intervention), full (53300), or the socket broke.
_CONNECTION_ERRORS = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.TooManyConnectionsError,
)


async def _ledger_write(ctx: ToolContext, tool: str, method: str, sql: str, *args: Any) -> Any:
    """One statement on the ledger. While the ledger is down nothing is written and the tool
    says so (``ToolUnavailable``: the executor tries again); once the statement is sent, a lost
    connection means nobody knows whether it committed (``OutcomeUnknown``: a payment goes in
    doubt, for an operator who reads the ledger), never a plain failure."""
    pool = _ledger(ctx, tool).pool
    try:
        connection = await pool.acquire(timeout=10)
    except _CONNECTION_ERRORS as e:
        raise ToolUnavailable(f"the ledger is unreachable ({type(e).__name__})") from e
    try:
        try:
            # A pooled connection can be dead since a server restart: find out before the write goes.
            await connection.execute("SELECT 1", timeout=10)
        except _CONNECTION_ERRORS as e:
            raise ToolUnavailable(f"the ledger is unreachable ({type(e).__name__})") from e
        try:
            return await getattr(connection, method)(sql, *args)
        except _CONNECTION_ERRORS as e:
            raise OutcomeUnknown(f"the ledger's connection was lost during the write ({type(e).__name__})") from e
    finally:
        with contextlib.suppress(*_CONNECTION_ERRORS):  # a broken connection is dropped, not reused
            await pool.release(connection)


async def payment(args: dict[str, Any], ctx: ToolContext) -> tuple[Any, int]:
    payment_id = await _ledger_write(
        ctx,
        "payment",
        "fetchval",
        "INSERT INTO agentlog_ledger.payments (idempotency_key, session_id, call_id, account, amount_cents) "
        "VALUES ($1, $2, $3, $4, $5) RETURNING id",
        ctx.idempotency_key,
        ctx.session_id,
        ctx.call_id,
        args["account"],
        int(args["amount_cents"]),
    )
    return {"payment_id": payment_id, "account": args["account"], "amount_cents": args["amount_cents"]}, 12


async def book(args: dict[str, Any], ctx: ToolContext) -> tuple[Any, int]:
    booking_id = await _ledger_write(
        ctx,
        "book",
        "fetchval",
        "INSERT INTO agentlog_ledger.bookings (idempotency_key, session_id, call_id, resource, nights, status) "
        "VALUES ($1, $2, $3, $4, $5, 'booked') RETURNING id",
        ctx.idempotency_key,
        ctx.session_id,
        ctx.call_id,
        args["resource"],
        int(args.get("nights", 1)),
    )
    return {"booking_id": booking_id, "resource": args["resource"]}, 10


async def cancel_booking(args: dict[str, Any], ctx: ToolContext) -> tuple[Any, int]:
    result = await _ledger_write(
        ctx,
        "cancel_booking",
        "execute",
        "UPDATE agentlog_ledger.bookings SET status = 'cancelled' WHERE session_id = $1 AND resource = $2 "
        "AND status = 'booked'",
        ctx.session_id,
        args["resource"],
    )
    return {"cancelled": int(result.split()[-1]), "resource": args["resource"]}, 6


IMPLEMENTATIONS: dict[str, ToolFn] = {
    "sleep": sleep,
    "echo": echo,
    "trace_tool": trace_tool,
    "file_write": file_write,
    "payment": payment,
    "book": book,
    "cancel_booking": cancel_booking,
}


def _counted(fn: ToolFn) -> Callable[[dict[str, Any], ToolContext], Awaitable[ToolOutput]]:
    """A built-in (which returns ``(result, tokens)``) in the form every registered tool has."""

    async def run(args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        result, tokens = await fn(args, ctx)
        return ToolOutput(result, tokens)

    run.__name__ = fn.__name__
    return run


BUILTIN_TOOLS: tuple[Tool, ...] = tuple(Tool(TOOLS[name], _counted(fn)) for name, fn in IMPLEMENTATIONS.items())
"""The built-in tools as registry entries (``workers/plugins.py`` registers them like any plugin's)."""


async def run_tool(tool: Tool, args: dict[str, Any], ctx: ToolContext) -> tuple[Any, int]:
    """Run a registered tool: ``(result, result_tokens)``.

    An ``async def`` is awaited; a plain function runs in a thread (it may block: it must not
    stall the executor's other calls). A result that is not a ``ToolOutput`` is counted at one
    token per four characters of its JSON.
    """
    if inspect.iscoroutinefunction(tool.function):
        output = await tool.function(args, ctx)
    else:
        output = await asyncio.to_thread(tool.function, args, ctx)
        if inspect.isawaitable(output):
            output = await output
    if isinstance(output, ToolOutput):
        return output.result, int(output.tokens)
    return output, _tokens(json.dumps(output, sort_keys=True))
