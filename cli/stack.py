"""Start and stop the whole stack as local processes: engine, planner(s), decider, executor.

With ``cache_manager=True`` it also starts the engine bridge (``workers.engine_bridge``:
the engine's KV events into ``kv.events``, ``kv.decisions`` into the engine) and the
cache manager (``workers.cache_manager``); ``engine_args`` and ``cache_manager_args``
pass options to the engine and the cache manager (e.g. ``--gpu-blocks N``). With
``gateway=True`` it starts the OpenAI-compatible gateway (``workers.gateway``) on
``gateway_port`` (0: a free port), in front of the engine; ``gateway_args`` pass it options.
With ``projector=True`` it starts the projector (``workers.projector``: the Postgres read model
of docs/projector.md); with ``console=True`` the web console (``workers.console``, docs/console.md)
on ``console_port``, ``console_args`` passed to it.

Every process is a plain ``python -m workers.<role>`` child with the log URL in
its environment, so ``kill -9`` of any of them is exactly what a crash is.
``Stack`` is used by ``logctl up``, ``logctl demo`` and the end-to-end tests.

With ``num_engines=N`` (``logctl up --engines N``) it starts N sim engines, ``engine`` (id
``sim-0``) and ``engine-1`` .. (``sim-1`` ..), each on its own port with its own state; the
planners route every LLM call between them (``AGENTLOG_ENGINES``, ``workers/engines/pool.py``),
and with the cache manager each engine gets its own bridge (``engine-bridge``,
``engine-bridge-1`` ..) while the one cache manager keeps a memory model per engine.
``engine_sizes`` gives each engine its model size (``large`` by default). The gateway routes
between them as the planners do (it reads the same ``AGENTLOG_ENGINES``); the decider's LLM
judge uses the first engine.

``Supervisor`` is what ``logctl up`` runs it with: a process that exits on its own (a crash,
a SIGKILL, even a clean exit nobody asked for) is started again after a backoff, and every
exit is reported; it never gives up on a role (``Backoff`` says why).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from log.local_kafka import free_ports


def free_port() -> int:
    """A free port outside the ephemeral range: a process restarted on it gets it back."""
    (port,) = free_ports(1)
    return port


@dataclass
class Process:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = self.log_path.open("ab")
        self.popen = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: a crash, no cleanup."""
        if self.alive():
            assert self.popen is not None
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait()

    def stop(self, timeout_s: float = 20) -> int | None:
        """SIGTERM, then wait (graceful shutdown drains in-flight work); SIGKILL if it hangs."""
        if self.popen is None:
            return None
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


_FULL_NAME_PRINCIPALS = ("engine-bridge", "cache-manager")


def is_engine(name: str) -> bool:
    """``engine``, ``engine-1``, ...: the sim engines (no principal: they do not touch the log)."""
    return name == "engine" or (name.startswith("engine-") and name[len("engine-") :].isdigit())


def engine_name(index: int) -> str:
    return "engine" if index == 0 else f"engine-{index}"


def bridge_name(index: int) -> str:
    return "engine-bridge" if index == 0 else f"engine-bridge-{index}"


_PRINCIPAL_OF = {"console": "operator"}
"""Processes named otherwise than their principal: the console appends as the operator."""


def _principal(name: str) -> str | None:
    """The Kafka principal a process of the stack logs in as (the engine has none)."""
    if is_engine(name):
        return None
    if name in _PRINCIPAL_OF:
        return _PRINCIPAL_OF[name]
    for principal in _FULL_NAME_PRINCIPALS:
        if name.startswith(principal):
            return principal
    return name.split("-")[0]


@dataclass
class Stack:
    """The processes of one local deployment."""

    log_url: str | None
    work_dir: Path
    time_scale: float = 1.0
    num_planners: int = 1
    engine_port: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)
    processes: dict[str, Process] = field(default_factory=dict)
    cache_manager: bool = False
    engine_args: list[str] = field(default_factory=list)
    cache_manager_args: list[str] = field(default_factory=list)
    metrics_port_base: int | None = None
    """Serve each worker's /metrics and /health on its own port from this one up (None: no metrics)."""
    metrics_ports: dict[str, int] = field(default_factory=dict)
    """The port each worker process got (stable across its restarts)."""
    gateway: bool = False
    gateway_port: int = 0
    gateway_args: list[str] = field(default_factory=list)
    projector: bool = False
    console: bool = False
    console_port: int = 0
    console_args: list[str] = field(default_factory=list)
    num_engines: int = 1
    engine_sizes: list[str] = field(default_factory=list)
    """Each engine's model size (small or large; missing ones are large)."""
    engine_ports: list[int] = field(default_factory=list)
    """Every engine's port (the first is ``engine_port``)."""

    def engine_id(self, index: int) -> str:
        return f"sim-{index}"

    def engine_size(self, index: int) -> str:
        return self.engine_sizes[index] if index < len(self.engine_sizes) else "large"

    def url_of(self, index: int) -> str:
        return f"http://127.0.0.1:{self.engine_ports[index]}"

    @property
    def engines_spec(self) -> str:
        """``AGENTLOG_ENGINES`` for the planners and the cache manager (workers/engines/pool.py)."""
        return ";".join(
            f"{self.engine_id(i)}={self.url_of(i)},size={self.engine_size(i)}" for i in range(self.num_engines)
        )

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("AGENTLOG_METRICS_PORT", None)  # one port for every process would collide: see _process
        if self.log_url:
            env["AGENTLOG_LOG_URL"] = self.log_url
        env["AGENTLOG_TIME_SCALE"] = str(self.time_scale)
        if self.num_engines > 1:
            env["AGENTLOG_ENGINES"] = self.engines_spec
        env.update(self.extra_env)
        env.update(extra or {})
        return env

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"

    @property
    def gateway_url(self) -> str:
        """The gateway's OpenAI base URL (what a client's ``base_url`` is set to)."""
        return f"http://127.0.0.1:{self.gateway_port}/v1"

    def _process(self, name: str, module: str, args: list[str], env: dict[str, str] | None = None) -> Process:
        # The process name is its stable member id: a restarted planner-0 is planner-0 again.
        env = self.env({"AGENTLOG_INSTANCE_ID": name, **(env or {})})
        if self.metrics_port_base is not None and module != "workers.engines.sim_server":
            port = self.metrics_ports.setdefault(name, self.metrics_port_base + len(self.metrics_ports))
            env["AGENTLOG_METRICS_PORT"] = str(port)
        if credentials := env.pop("AGENTLOG_KAFKA_CREDENTIALS", None):
            # A secure broker: each process logs in as its own role, with only its own password
            # (the per-principal files beside credentials.json), never with the operator's.
            principal = _principal(name)
            env.pop("AGENTLOG_KAFKA_PASSWORD", None)
            env.pop("AGENTLOG_KAFKA_USERNAME", None)
            env.pop("AGENTLOG_KAFKA_PASSWORD_FILE", None)
            if principal:
                env["AGENTLOG_KAFKA_USERNAME"] = principal
                env["AGENTLOG_KAFKA_PASSWORD_FILE"] = str(Path(credentials).parent / "secrets" / principal)
        return Process(name, [sys.executable, "-m", module, *args], env, self.work_dir / "logs" / f"{name}.log")

    def start(self, *, wait_s: float = 60) -> Stack:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.engine_port = self.engine_port or free_port()
        self.engine_ports = [self.engine_port] + [free_port() for _ in range(1, self.num_engines)]
        for i in range(self.num_engines):
            self.start_process(engine_name(i))
        for i in range(self.num_engines):
            self.wait_for_engine(wait_s, i)
        for role in ("decider", "executor"):
            self.start_process(role)
        for i in range(self.num_planners):
            self.start_process(f"planner-{i}")
        if self.cache_manager:
            for i in range(self.num_engines):
                self.start_process(bridge_name(i))
            self.start_process("cache-manager")
        if self.gateway:
            self.gateway_port = self.gateway_port or free_port()
            self.start_process("gateway")
        if self.projector:
            self.start_process("projector")
        if self.console:
            self.console_port = self.console_port or free_port()
            self.start_process("console")
        return self

    def start_process(self, name: str, env: dict[str, str] | None = None) -> Process:
        """Start (or restart) one process of the stack by name: engine, decider, executor, planner-N,
        engine-bridge, cache-manager, gateway, projector, console."""
        if is_engine(name):
            i = 0 if name == "engine" else int(name.rsplit("-", 1)[1])
            args = ["--port", str(self.engine_ports[i] if self.engine_ports else self.engine_port)]
            args += ["--state-dir", str(self.work_dir / name), *self.engine_args]
            if self.num_engines > 1:
                args += ["--engine-id", self.engine_id(i)]
            process = self._process(name, "workers.engines.sim_server", args, env)
        elif name.startswith("engine-bridge"):
            i = 0 if name == "engine-bridge" else int(name.rsplit("-", 1)[1])
            args = ["--engine", "sim", "--engine-url", self.url_of(i) if self.engine_ports else self.engine_url]
            if self.num_engines > 1:
                args += ["--engine-id", self.engine_id(i)]
            process = self._process(name, "workers.engine_bridge", args, env)
        elif name == "cache-manager":
            process = self._process(name, "workers.cache_manager", list(self.cache_manager_args), env)
        elif name.startswith("planner"):
            process = self._process(name, "workers.planner", ["--engine-url", self.engine_url], env)
        elif name == "decider":  # the llm_judge voter asks the same engine
            process = self._process(name, "workers.decider", ["--engine-url", self.engine_url], env)
        elif name == "gateway":
            args = ["--engine-url", self.engine_url, "--port", str(self.gateway_port), *self.gateway_args]
            process = self._process(name, "workers.gateway", args, env)
        elif name == "console":
            process = self._process(
                name, "workers.console", ["--port", str(self.console_port), *self.console_args], env
            )
        elif name == "executor":
            process = self._process(name, "workers.executor", ["--sandbox", str(self.work_dir / "sandbox")], env)
        else:
            process = self._process(name, f"workers.{name}", [], env)
        self.processes[name] = process.start()
        return process

    def wait_for_engine(self, wait_s: float, index: int = 0) -> None:
        url = self.url_of(index) if self.engine_ports else self.engine_url
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            engine = self.processes[engine_name(index)]
            if not engine.alive():
                raise RuntimeError(f"the engine exited:\n{engine.log_tail()}")
            time.sleep(0.1)
        raise TimeoutError(f"the engine did not answer on {url} within {wait_s:g} s")

    def stop(self) -> dict[str, int | None]:
        """Stop everything gracefully (workers first, the engines last); returns exit codes."""
        codes = {}
        for name in [n for n in self.processes if not is_engine(n)] + [n for n in self.processes if is_engine(n)]:
            codes[name] = self.processes[name].stop()
        return codes

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Backoff:
    """How long to wait before starting a role again after it exited.

    The first restart waits ``first_s``; each exit after a short life doubles the wait, up to
    ``max_s``; a process that stayed up ``reset_after_s`` or more starts over at ``first_s``.
    There is no last attempt: a role that keeps exiting (its server is down, say) is retried
    every ``max_s`` and reported each time, so it comes back on its own once the cause is gone,
    and an operator sees every exit in ``logctl up``'s output meanwhile.
    """

    first_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0
    num_exits: int = 0
    """Exits in a row, each after a short life."""

    def after_exit(self, uptime_s: float) -> float:
        """The wait before the next start of a process that exited after ``uptime_s`` seconds."""
        if uptime_s >= self.reset_after_s:
            self.num_exits = 0
        self.num_exits += 1
        return min(self.first_s * 2.0 ** (self.num_exits - 1), self.max_s)


def describe_exit(code: int | None) -> str:
    """``code 3`` or ``code -9, SIGKILL`` (Popen's negative code is the signal)."""
    if code is not None and code < 0:
        try:
            return f"code {code}, {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"code {code}"


@dataclass
class Supervisor:
    """Keeps every process of a stack running: call ``check()`` every fraction of a second.

    A process found dead is reported (one line: role, exit code, the wait) and started again
    once its ``Backoff`` wait is over; ``report`` gets each line.
    """

    stack: Stack
    report: Callable[[str], None]
    clock: Callable[[], float] = time.monotonic
    backoff: Callable[[], Backoff] = Backoff
    _backoffs: dict[str, Backoff] = field(default_factory=dict)
    _started_at: dict[str, float] = field(default_factory=dict)
    _restart_at: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        now = self.clock()  # uptimes count from here
        self._started_at = dict.fromkeys(self.stack.processes, now)

    def check(self) -> None:
        now = self.clock()
        for name, process in self.stack.processes.items():
            if name in self._restart_at or process.alive():
                continue
            started = self._started_at.setdefault(name, now)
            backoff = self._backoffs.setdefault(name, self.backoff())
            wait_s = backoff.after_exit(now - started)
            self._restart_at[name] = now + wait_s
            code = process.popen.returncode if process.popen else None
            self.report(
                f"{name} exited ({describe_exit(code)}) after {now - started:.1f} s; starting it again in "
                f"{wait_s:g} s (exit {backoff.num_exits} in a row; its log: {process.log_path})"
            )
        for name, when in list(self._restart_at.items()):
            if now >= when:
                del self._restart_at[name]
                self._started_at[name] = now
                self.report(f"{name} started again: pid {self.stack.start_process(name).pid}")
