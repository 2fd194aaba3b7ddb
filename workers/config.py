"""Configuration shared by the role workers: where snapshots and partition marks live, how often marks are saved.

``workers/main.py`` parses the options every role has (log URL, group, instance id);
the roles that keep marks add ``--snapshot-url`` here (the planner has its own, same
meaning) and open the store with ``open_snapshot_store``.
"""

from __future__ import annotations

import argparse
import logging
import os

import asyncpg

from log import SharedLog
from log.snapshots import SnapshotStore
from services.scheduling import PROGRAM_ORDER, SchedulingConfig

__all__ = ["add_snapshot_arguments", "default_mark_every", "log_namespace", "open_snapshot_store", "snapshot_url"]

_log = logging.getLogger(__name__)


def default_mark_every() -> int:
    """Events folded in a partition between two of its marks (``AGENTLOG_MARK_EVERY``, default 500)."""
    return int(os.environ.get("AGENTLOG_MARK_EVERY", "500"))


def log_namespace(log: SharedLog) -> str:
    return str(getattr(log.backend, "namespace", "") or "")


def snapshot_url(explicit: str | None, log_url: str | None) -> str | None:
    """Where snapshots (and marks) go: an explicit URL, else the ledger's or the test Postgres,
    else a Postgres log itself."""
    for candidate in (
        explicit,
        os.environ.get("AGENTLOG_SNAPSHOT_URL"),
        os.environ.get("AGENTLOG_LEDGER_URL"),
        os.environ.get("AGENTLOG_PG_URL"),
    ):
        if candidate:
            return candidate
    url = log_url or os.environ.get("AGENTLOG_LOG_URL") or ""
    return url if url.startswith(("postgresql://", "postgres://")) else None


def add_snapshot_arguments(parser: argparse.ArgumentParser) -> None:
    """``--snapshot-url`` for roles that only read snapshots (the planner has its own, same meaning)."""
    parser.add_argument(
        "--snapshot-url",
        default=None,
        help="Postgres of snapshots and partition marks (default: AGENTLOG_SNAPSHOT_URL, AGENTLOG_LEDGER_URL, "
        "AGENTLOG_PG_URL, or the log itself when it is Postgres; none: replay partitions from offset 0)",
    )


async def open_snapshot_store(log: SharedLog, args: argparse.Namespace) -> SnapshotStore | None:
    """The store of snapshots and marks for a role that only reads snapshots and keeps marks; None
    (replay from offset 0) when there is none or it cannot be opened: marks only save time."""
    url = snapshot_url(getattr(args, "snapshot_url", None), getattr(args, "log_url", None))
    if not url:
        return None
    try:
        return await SnapshotStore(url, log_namespace(log)).start()
    except (OSError, asyncpg.PostgresError) as e:
        _log.warning("no snapshot store (%s): partitions are replayed from offset 0", e)
        return None


SCHEDULING_MODES = ("plas", "programs", "off")
"""``--scheduling`` of the planner and the gateway: plas sends each engine request its program-level
priority (``services.scheduling``), programs the same without the attained-service term (programs in
the order they started, ``PROGRAM_ORDER``: what an engine with ranked pins needs), off sends none."""


def scheduling_config(mode: str | None, *, default: str) -> SchedulingConfig | None:
    """The policy for ``--scheduling MODE`` (None: ``AGENTLOG_SCHEDULING``, else ``default``); None
    when off. vLLM refuses a non-zero priority unless its server runs ``--scheduling-policy
    priority``, which is why a process that may front vLLM defaults to off."""
    mode = mode or os.environ.get("AGENTLOG_SCHEDULING") or default
    if mode not in SCHEDULING_MODES:
        raise ValueError(f"AGENTLOG_SCHEDULING must be one of {', '.join(SCHEDULING_MODES)}, not {mode!r}")
    return {"plas": SchedulingConfig(), "programs": PROGRAM_ORDER}.get(mode)
