"""``logctl up`` keeps its processes running: a worker SIGKILLed under it comes back (after a
backoff that doubles while it keeps dying), each exit is reported in one line, sessions still
finish, and SIGTERM still drains everything and exits 0. Real processes on the real Postgres log."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cli.common import ensure_topics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = {
    "steps": [
        {"llm": {"prompt_tokens": 32, "output_tokens": 4}},
        {"tool": "sleep", "arguments": {"seconds": 0.2}},
        {"llm": {"prompt_tokens": 16, "output_tokens": 4}},
    ]
}


class Lines:
    """Every line ``logctl up`` prints, read in a thread; ``wait`` for one matching a pattern."""

    def __init__(self, stream: object) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._stream = stream
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def close(self) -> None:
        """After the process exited: take its last lines, close the pipe."""
        self._reader.join(timeout=10)
        self._stream.close()  # type: ignore[attr-defined]

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait(self, pattern: str, after: int = 0, timeout_s: float = 60) -> tuple[int, re.Match[str]]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for i, line in enumerate(self.lines[after:], after):
                    if match := re.search(pattern, line):
                        return i, match
                left = deadline - time.monotonic()
                assert left > 0, f"no line matching {pattern!r} in:\n" + "\n".join(self.lines)
                self._cond.wait(left)


def test_up_restarts_a_killed_worker_with_backoff_and_still_drains(pg_url: str, namespace: str, tmp_path: Path) -> None:
    env = {**os.environ, "AGENTLOG_NAMESPACE": namespace, "AGENTLOG_LEDGER_URL": pg_url}
    ensure_topics(pg_url, namespace=namespace)
    argv = [sys.executable, "-m", "cli.main", "up", "--log-url", pg_url, "--time-scale", "0.05",
            "--work-dir", str(tmp_path)]  # fmt: skip
    up = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = Lines(up.stdout)
    try:
        i, first = lines.wait(r"^executor\s+pid (\d+)")
        lines.wait(r"^running")
        # Killed twice in a row, soon after each start: the second wait is twice the first.
        os.kill(int(first[1]), signal.SIGKILL)
        i, exited = lines.wait(r"executor exited \(code -9, SIGKILL\).* again in ([\d.]+) s \(exit 1 in a row", i)
        i, again = lines.wait(r"executor started again: pid (\d+)", i)
        os.kill(int(again[1]), signal.SIGKILL)
        i, exited_twice = lines.wait(r"executor exited \(code -9, SIGKILL\).* again in ([\d.]+) s \(exit 2 in a row", i)
        assert float(exited_twice[1]) == 2 * float(exited[1])
        i, back = lines.wait(r"executor started again: pid (\d+)", i)

        ran = subprocess.run(
            [sys.executable, "-m", "cli.main", "run", "script", "--log-url", pg_url, "-n", "3",
             "--args", json.dumps(STEPS), "--json", "--timeout", "120"],
            env=env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert json.loads(ran.stdout.strip().splitlines()[-1])["finished"] == 3
        assert Path(f"/proc/{back[1]}").exists(), "the restarted executor ran the sessions' tools"
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
        lines.close()
    assert up.returncode == 0, "\n".join(lines.lines)
    stopped = lines.lines[-1]
    assert stopped.startswith("stopped:") and all(part.endswith("=0") for part in stopped[9:].split(", ")), stopped
