"""``logctl up`` as the stack tests start it: a real process that starts every worker, and
stopped as a process manager stops it (SIGTERM, which must drain every process).

One place for it, so each test says only which flags its stack needs and what it checks."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["Stack", "logctl_up"]


@dataclass
class Stack:
    process: subprocess.Popen[str]
    started: list[str] = field(default_factory=list)  # the lines printed before "running", one per process
    output: str = ""  # what it printed after "running", read when it stopped

    @property
    def names(self) -> set[str]:
        return {line.split()[0] for line in self.started}


@contextmanager
def logctl_up(log_url: str, *flags: str, env: Mapping[str, str]) -> Iterator[Stack]:
    """Yield once every process is running. When the body passed, the stack must stop cleanly:
    exit code 0 and every process drained (``stopped: name=0, ...``)."""
    argv = [sys.executable, "-c", "from cli.main import app; app()", "up", "--log-url", log_url, *flags]
    up = subprocess.Popen(argv, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stack = Stack(up)
    try:
        assert up.stdout is not None
        while not (line := up.stdout.readline()).startswith("running"):
            assert line, f"logctl up exited early: {stack.started}"
            stack.started.append(line)
        yield stack
    finally:
        up.send_signal(signal.SIGTERM)
        stack.output, _ = up.communicate(timeout=60)
    assert up.returncode == 0, stack.output
    stopped = stack.output.strip().splitlines()[-1]
    assert stopped.startswith("stopped:") and all(part.endswith("=0") for part in stopped[9:].split(", ")), stopped
