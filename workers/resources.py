"""Resources a tool acquires through the executor: creating them, finding them again, releasing them.

The policy (what is owned, what to release when) is pure, in ``services/resources.py``; this
module is the mechanism. Every resource gets a *location* derived from its session and id
(``token``) before it exists, so that whoever reads the log can find it without the process
that created it:

=========== ============================================== ===========================================
kind        location (logged before it exists)             release (idempotent: gone is released)
=========== ============================================== ===========================================
directory   ``<root>/<token>/``                            ``rm -r``
file        ``<root>/<token><suffix>``                     ``unlink``
process     ``AGENTLOG_RESOURCE=<token>`` in its           SIGTERM to every process carrying the
            environment (children inherit it), own         marker, SIGKILL after ``grace_s``; alive
            session and process group                      after SIGKILL: the release fails
port        (the kernel picks it: logged when bound)       close the listening socket (a dead
                                                           executor's sockets died with it)
container   ``agentlog-<token>``, label                    ``docker rm -f``
            ``agentlog.resource=<token>``
=========== ============================================== ===========================================

A release that fails raises ``ReleaseError`` with the reason; the executor logs it and
retries after a backoff. Blocking work (``rm -r``, waiting for a process to die, ``docker``)
runs in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas import events as ev
from schemas.events import ResourceKind
from services.resources import Reason, Resource, backoff_ms, resource_id

__all__ = ["Lease", "ReleaseError", "ResourceManager", "ToolResources", "marked_pids", "token"]

MARKER = "AGENTLOG_RESOURCE"
CONTAINER_LABEL = "agentlog.resource"
_TOKENS = uuid.UUID("0b8f3f0e-5c7e-4f55-9d8e-3a4c6b1d2e90")


class ReleaseError(Exception):
    """A resource could not be released (yet); the message says why."""


class NotCreated(RuntimeError):
    """An acquisition that failed before it created anything (there is nothing to release)."""


def token(session_id: str, rid: str) -> str:
    """A short name for a resource that is safe in paths, container names and environments."""
    return "r" + uuid.uuid5(_TOKENS, f"{session_id}/{rid}").hex[:20]


@dataclass
class Lease:
    """What a tool gets for a resource it acquired; the session owns it (release is optional)."""

    resource_id: str
    kind: ResourceKind
    path: Path | None = None
    """A directory or a file."""
    process: subprocess.Popen[bytes] | None = None
    port: int | None = None
    socket: socket.socket | None = None
    """The listening socket that holds the port (pass it to a child with ``pass_fds``, or close it and bind)."""
    container: str | None = None
    """The container's name."""

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


# --------------------------------------------------------------- processes


def _state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def marked_pids(marker_token: str) -> list[int]:
    """Live (not zombie) processes whose environment carries ``AGENTLOG_RESOURCE=<token>``."""
    needle = f"{MARKER}={marker_token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if needle in environ.split(b"\0") and _state(int(entry.name)) not in (None, "Z", "X"):
            found.append(int(entry.name))
    return sorted(found)


def _signal_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(pid, sig)


def _wait_gone(marker_token: str, deadline: float, reap: subprocess.Popen[bytes] | None) -> list[int]:
    while True:
        if reap is not None:
            reap.poll()  # our own child: reap it, or it lingers as a zombie
        alive = marked_pids(marker_token)
        if not alive:
            if reap is not None and reap.returncode is None:
                reap.wait(timeout=5)  # it is a zombie by now (marked_pids skips those): collect it
            return alive
        if time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def kill_marked(marker_token: str, grace_s: float, reap: subprocess.Popen[bytes] | None = None) -> str:
    """SIGTERM every marked process, SIGKILL what is left after ``grace_s``; what it took, in words."""
    alive = marked_pids(marker_token)
    if not alive:
        _wait_gone(marker_token, 0.0, reap)
        return "no process left"
    _signal_all(alive, signal.SIGTERM)
    left = _wait_gone(marker_token, time.monotonic() + grace_s, reap)
    if not left:
        return f"{len(alive)} process(es) ended on SIGTERM"
    _signal_all(left, signal.SIGKILL)
    still = _wait_gone(marker_token, time.monotonic() + 2.0, reap)
    if still:
        raise ReleaseError(f"process(es) {still} still alive 2 s after SIGKILL (state {_state(still[0])})")
    return f"killed {left} with SIGKILL after SIGTERM was ignored for {grace_s:g} s"


# -------------------------------------------------------------- containers


def _docker(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    docker = shutil.which("docker")
    if docker is None:
        raise ReleaseError("no docker command on PATH: cannot reach a Docker engine")
    return subprocess.run([docker, *args], capture_output=True, text=True, timeout=timeout_s, check=False)


def docker_available() -> bool:
    try:
        return _docker("info", "--format", "{{.ServerVersion}}", timeout_s=10).returncode == 0
    except (ReleaseError, subprocess.TimeoutExpired):
        return False


# ----------------------------------------------------------------- manager

AppendFn = Callable[[str, ev.Event, str, str], Awaitable[None]]
"""``append(session_id, body, kind, key)``: the executor's deterministic append."""


@dataclass
class ResourceManager:
    """Creates and releases the executor's resources; holds what only this process can hold (sockets,
    child processes to reap), by (session, resource id)."""

    root: Path
    append: AppendFn
    grace_s: float = 2.0
    """How long a process gets between SIGTERM and SIGKILL."""
    crash: Callable[[str, str], None] = lambda point, tool: None
    release_by_id: Callable[[str, str, str], Awaitable[None]] | None = None
    """``(session_id, resource_id, reason)``: the executor's logged release (a tool's early release)."""
    _live: dict[tuple[str, str], Lease] = field(default_factory=dict)

    def location(self, kind: ResourceKind, session_id: str, rid: str, suffix: str = "") -> str:
        name = token(session_id, rid)
        match kind:
            case ResourceKind.DIRECTORY:
                return str(self.root / name)
            case ResourceKind.FILE:
                return str(self.root / f"{name}{suffix}")
            case ResourceKind.PROCESS:
                return f"{MARKER}={name}"
            case ResourceKind.CONTAINER:
                return f"agentlog-{name}"
            case ResourceKind.PORT:
                return ""

    def scope(self, session_id: str, call_id: str, tool: str, attempt: int) -> ToolResources:
        return ToolResources(self, session_id, call_id, tool, attempt)

    async def release(self, session_id: str, resource: Resource) -> str:
        """Make it gone; what it took, in words. Raises ``ReleaseError``."""
        lease = self._live.get((session_id, resource.resource_id))
        try:
            detail = await asyncio.to_thread(self._release, session_id, resource, lease)
        except ReleaseError:
            raise
        except Exception as e:  # e.g. PermissionError from rm -r
            raise ReleaseError(f"{type(e).__name__}: {e}") from None
        self._live.pop((session_id, resource.resource_id), None)
        return detail

    def _release(self, session_id: str, r: Resource, lease: Lease | None) -> str:
        name = token(session_id, r.resource_id)
        match r.kind:
            case ResourceKind.DIRECTORY:
                path = Path(r.location)
                if not path.exists():
                    return "already gone"
                shutil.rmtree(path)
                return f"removed {path}"
            case ResourceKind.FILE:
                path = Path(r.location)
                if not path.exists():
                    return "already gone"
                path.unlink()
                return f"removed {path}"
            case ResourceKind.PROCESS:
                return kill_marked(name, self.grace_s, lease.process if lease else None)
            case ResourceKind.PORT:
                if lease is not None and lease.socket is not None:
                    lease.socket.close()
                    return f"closed the socket on port {lease.port}"
                return "its socket died with the executor that held it"
            case ResourceKind.CONTAINER:
                done = _docker("rm", "-f", r.location)
                if done.returncode == 0:
                    return f"removed container {r.location}"
                if "No such container" in done.stderr:
                    return "already gone"
                raise ReleaseError(f"docker rm -f {r.location}: {done.stderr.strip() or done.returncode}")

    # -------------------------------------------------------------- acquire

    async def acquire(
        self, scope: ToolResources, kind: ResourceKind, create: Callable[[str], Lease], suffix: str = ""
    ) -> Lease:
        """Log the intent (with the location), create, log the handle. A creation that fails is
        released at once (it may have half happened) and re-raised to the tool."""
        rid = resource_id(scope.call_id, scope.attempt, scope.num_acquired)
        scope.num_acquired += 1
        location = self.location(kind, scope.session_id, rid, suffix)
        intent = ev.ResourceAcquiring(
            resource_id=rid, call_id=scope.call_id, tool=scope.tool, kind=kind, location=location
        )
        await self.append(scope.session_id, intent, "resource-acquiring", rid)
        self.crash("executor.after_resource_logged", scope.tool)
        try:
            lease = await asyncio.to_thread(create, location)
        except BaseException as error:
            reason = f"acquisition failed: {type(error).__name__}: {error}"
            placeholder = Resource(rid, scope.call_id, scope.tool, kind, location, acquiring_at=_epoch())
            body: ev.Event
            try:
                detail = (
                    "never created"
                    if isinstance(error, NotCreated)
                    else await self.release(scope.session_id, placeholder)
                )
                body = ev.ResourceReleased(resource_id=rid, reason=reason, detail=detail)
                await self.append(scope.session_id, body, "resource-released", rid)
            except ReleaseError as stuck:  # it may half exist: the executor retries like any stuck one
                body = ev.ResourceReleaseFailed(
                    resource_id=rid, attempt=1, reason=reason, error=str(stuck), retry_in_ms=backoff_ms(1)
                )
                await self.append(scope.session_id, body, "resource-release-failed", f"{rid}/1")
            raise
        self._live[(scope.session_id, rid)] = lease
        lease.resource_id = rid
        handle = _handle(lease)
        await self.append(
            scope.session_id, ev.ResourceAcquired(resource_id=rid, handle=handle), "resource-acquired", rid
        )
        self.crash("executor.after_resource_acquired", scope.tool)
        return lease


def _epoch() -> Any:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(0, UTC)


def _handle(lease: Lease) -> str:
    if lease.process is not None:
        return str(lease.process.pid)
    if lease.port is not None:
        return str(lease.port)
    if lease.container is not None:
        return lease.container
    return str(lease.path)


@dataclass
class ToolResources:
    """``ctx.resources``: what one attempt of one tool call may acquire. Everything it acquires is
    owned by the session and released by the executor when the session ends (or earlier with
    ``release``); all methods are coroutines (an ``async def`` tool awaits them)."""

    manager: ResourceManager
    session_id: str
    call_id: str
    tool: str
    attempt: int
    num_acquired: int = 0

    async def directory(self) -> Lease:
        """A fresh, empty directory (``lease.path``)."""

        def create(location: str) -> Lease:
            path = Path(location)
            path.mkdir(parents=True, exist_ok=True)
            return Lease("", ResourceKind.DIRECTORY, path=path)

        return await self.manager.acquire(self, ResourceKind.DIRECTORY, create)

    async def temp_file(self, suffix: str = "") -> Lease:
        """A fresh, empty file (``lease.path``); ``suffix`` like ``.json``."""
        if suffix and not (suffix.startswith(".") and suffix[1:].replace("_", "").isalnum()):
            raise ValueError(f"suffix {suffix!r} must be a dot and letters or digits, like '.json'")

        def create(location: str) -> Lease:
            path = Path(location)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
            return Lease("", ResourceKind.FILE, path=path)

        return await self.manager.acquire(self, ResourceKind.FILE, create, suffix)

    async def process(
        self, argv: Sequence[str], *, cwd: Path | None = None, env: dict[str, str] | None = None, **popen: Any
    ) -> Lease:
        """Start ``argv`` (``lease.process``, a ``subprocess.Popen``) in its own session and process
        group, marked so that a restarted executor finds it and its children."""
        if not argv:
            raise ValueError("process needs a command (argv is empty)")

        def create(location: str) -> Lease:
            key, _, value = location.partition("=")
            environment = {**(env if env is not None else os.environ), key: value}
            child = subprocess.Popen(list(argv), cwd=cwd, env=environment, start_new_session=True, **popen)
            return Lease("", ResourceKind.PROCESS, process=child)

        return await self.manager.acquire(self, ResourceKind.PROCESS, create)

    async def port(self, host: str = "127.0.0.1") -> Lease:
        """A free TCP port, held by a listening socket (``lease.port``, ``lease.socket``)."""

        def create(location: str) -> Lease:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sock.listen()
            return Lease("", ResourceKind.PORT, port=sock.getsockname()[1], socket=sock)

        return await self.manager.acquire(self, ResourceKind.PORT, create)

    async def container(self, image: str, command: Sequence[str] = ()) -> Lease:
        """A running container of ``image`` (``lease.container``: its name); needs a Docker engine."""

        def create(location: str) -> Lease:
            if not docker_available():
                raise NotCreated("no Docker engine answers (docker info failed): cannot start a container")
            run = _docker(
                "run", "-d", "--name", location, "--label", f"{CONTAINER_LABEL}={location}", image, *command
            )  # fmt: skip
            if run.returncode != 0:
                raise RuntimeError(f"docker run {image}: {run.stderr.strip()}")
            return Lease("", ResourceKind.CONTAINER, container=location)

        return await self.manager.acquire(self, ResourceKind.CONTAINER, create)

    async def release(self, lease: Lease) -> None:
        """Release it now instead of at the session's end (idempotent)."""
        if self.manager.release_by_id is None:
            raise RuntimeError("this executor cannot release resources early")
        await self.manager.release_by_id(self.session_id, lease.resource_id, Reason.BY_TOOL)
