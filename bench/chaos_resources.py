"""What a chaos run's sessions acquired, released and left behind: from the log and on the machine.

The chaos mix's ``chaos_hold`` tool (``bench/chaos_tools.py``) acquires a directory, a process and
a port per session through the executor. After a run:

- from the log (the sessions' folded resources): every acquisition (``ResourceAcquiring``) has
  its ``ResourceReleased``; how many were released at the session's end and how many a restarted
  executor reclaimed from a dead one;
- on the machine, counted the way ``bench/resources.py`` and ``tests/integration/test_resources.py``
  count, not read from the log: entries under the executor's resource directory, live processes
  carrying the run's tag in their environment, and the ports the log's acquisitions bound that a
  process of the run still listens on.

Processes of the run are those whose environment carries ``AGENTLOG_CHAOS_WORK=<work dir>`` (the
stack's processes and what they start) or whose command line names the work directory (the
broker, Postgres). A port counts as left only if one of them holds its listening socket: on a
shared machine another program may bind a port the kernel handed out again after its release.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from schemas.events import ResourceKind
from services.resources import Reason, ResourceStatus
from services.session import SessionState

WORK_TAG = "AGENTLOG_CHAOS_WORK"

RECLAIMED = frozenset({Reason.DEAD_ATTEMPT, Reason.DEAD_HOLDER})
"""Release reasons of a restarted executor reclaiming what a dead one left."""


@dataclass
class ResourceCount:
    acquired: int = 0
    """Acquisitions in the log (``ResourceAcquiring``: logged before the resource exists)."""
    released_at_end: int = 0
    reclaimed: int = 0
    """Released by a restarted executor: the holder or the tool's attempt died with a SIGKILL."""
    released_other: int = 0
    not_released: list[str] = field(default_factory=list)
    """``session/resource id (kind, status)`` of each acquisition without its release in the log."""
    dirs_left: int = -1
    """-1: not counted (an interrupted run)."""
    processes_left: int = -1
    ports_left: int = -1

    @property
    def ok(self) -> bool:
        return (
            self.acquired > 0
            and not self.not_released
            and self.acquired == self.released_at_end + self.reclaimed + self.released_other
            and (self.dirs_left, self.processes_left, self.ports_left) == (0, 0, 0)
        )


def count_log(states: Iterable[SessionState]) -> ResourceCount:
    """Every acquisition of these sessions and how the log says it ended."""
    count = ResourceCount()
    ends = {Reason.FINISHED, Reason.FAILED, Reason.CANCELLED}
    for state in states:
        for r in state.resources.values():
            count.acquired += 1
            if r.status is not ResourceStatus.RELEASED:
                count.not_released.append(f"{state.session_id}/{r.resource_id} ({r.kind.value}, {r.status.value})")
            elif r.reason in ends:
                count.released_at_end += 1
            elif r.reason in RECLAIMED:
                count.reclaimed += 1
            else:
                count.released_other += 1  # e.g. an acquisition that failed and was undone at once
    return count


def logged_ports(states: Iterable[SessionState]) -> list[int]:
    """The ports the sessions' acquisitions bound (their handles)."""
    return [
        int(r.handle)
        for s in states
        for r in s.resources.values()
        if r.kind is ResourceKind.PORT and r.handle is not None and r.handle.isdigit()
    ]


# ------------------------------------------------------------------------------ the machine


def _proc_state(pid: str) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _live_pids() -> list[str]:
    return [e.name for e in Path("/proc").iterdir() if e.name.isdigit() and _proc_state(e.name) not in (None, "Z", "X")]


def tagged_pids(key: str, value: str) -> list[int]:
    """Live (not zombie) processes whose environment carries ``key=value`` (children inherit it)."""
    needle = f"{key}={value}".encode()
    found = []
    for pid in _live_pids():
        with contextlib.suppress(OSError):  # gone meanwhile
            if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(int(pid))
    return sorted(found)


def _ancestors() -> set[int]:
    found, pid = set(), os.getpid()
    while pid > 1:
        found.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return found


def run_pids(work_dir: Path) -> list[int]:
    """Live processes of the run: its tag in their environment (the stack's processes and what
    they start), or its broker's or Postgres's data directory in their command line (those are
    started without the tag). Never this process or one of its parents (a shell that started
    the run names the work directory too)."""
    needles = (str(work_dir / "kafka").encode(), str(work_dir / "pg").encode())
    tag = f"{WORK_TAG}={work_dir}".encode()
    mine = _ancestors()
    found = []
    for pid in _live_pids():
        if int(pid) in mine:
            continue
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            if any(n in argv for n in needles) or tag in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(int(pid))
    return sorted(found)


def describe_pid(pid: int) -> str:
    """``pid command line`` (shortened), for a report."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        argv = "(gone)"
    return f"{pid} {argv[:160]}"


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(inode)
    return inodes


def listener_pids(port: int, among: Iterable[int]) -> list[int]:
    """Which of ``among`` hold a socket listening on ``port``."""
    inodes = {f"socket:[{i}]" for i in _listening_inodes(port)}
    if not inodes:
        return []
    holders = []
    for pid in among:
        with contextlib.suppress(OSError):
            fds = Path(f"/proc/{pid}/fd")
            if any(os.readlink(fd) in inodes for fd in fds.iterdir()):
                holders.append(pid)
    return holders


def count_ports_left(ports: Iterable[int], work_dir: Path) -> int:
    """Ports of the log's acquisitions that a process of the run still listens on."""
    ours = run_pids(work_dir)
    return sum(1 for port in set(ports) if listener_pids(port, ours))


def entries_left(resource_dir: Path) -> int:
    """Directories and files under the executor's resource directory (each resource is one entry there)."""
    return sum(1 for _ in resource_dir.iterdir()) if resource_dir.is_dir() else 0


def kill_all(pids: Iterable[int]) -> None:
    """SIGKILL what a run left (after it was counted): the machine is as before the run."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
