"""docker-compose.yml on a real Docker engine: the whole stack, secure, from images built here.

No image registry is reachable on these machines, so ``build_images.sh`` makes stand-ins for the
official images (Debian base from mmdebstrap, Kafka from the Maven jars, Postgres from Debian)
and builds the project's Dockerfile on them; the compose file is pointed at them through its
``AGENTLOG_*_IMAGE`` variables and used unchanged otherwise. The test runs sessions (one of them
a payment held for approval), crashes the executor (SIGKILL of its process: the restart policy
brings it back) and ``docker kill``s the planner (a manual stop: started again as an operator
would), and checks from the log and the ledger that every session finished, that the payment
ran exactly once, that the projector's read model holds the finished sessions (the console's
health check passes on it) and that ``logctl verify`` passes. Skipped where no Docker engine answers,
unless ``AGENTLOG_REQUIRE_DOCKER=1`` (CI sets it when it started one).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.stack import free_port

pytestmark = [pytest.mark.compose, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"
IMAGES = {
    "AGENTLOG_IMAGE": "agentlog:test",
    "AGENTLOG_KAFKA_IMAGE": "agentlog-test/kafka:4.1.1",
    "AGENTLOG_POSTGRES_IMAGE": "agentlog-test/postgres:15",
}
ECHO = {
    "steps": [
        {"llm": {"prompt_tokens": 40, "output_tokens": 4}},
        {"tool": "echo", "arguments": {"text": "hi"}},
        {"llm": {"prompt_tokens": 8, "output_tokens": 4}},
    ]
}
PAYMENT = {
    "steps": [
        {"llm": {"prompt_tokens": 40, "output_tokens": 4}},
        {"tool": "payment", "arguments": {"account": "x", "amount_cents": 9}},
        {"llm": {"prompt_tokens": 8, "output_tokens": 4}},
    ]
}


def _docker_answers() -> bool:
    if shutil.which(DOCKER) is None or shutil.which("docker-compose") is None:
        return False
    return subprocess.run([DOCKER, "info"], capture_output=True, check=False).returncode == 0


class Compose:
    """``docker-compose`` on the repository's file, in a project and with an env file of its own."""

    def __init__(self, env_file: Path, project: str) -> None:
        self.project = project
        self.argv = ["docker-compose", "--env-file", str(env_file), "-p", project]
        self.env = {
            **os.environ,
            **IMAGES,
            "AGENTLOG_TIME_SCALE": "0.01",
            "DOCKER_HOST": os.environ.get("DOCKER_HOST", ""),
        }
        self.env["AGENTLOG_KAFKA_PORT"] = str(free_port())
        self.env["AGENTLOG_POSTGRES_PORT"] = str(free_port())
        if not self.env["DOCKER_HOST"]:
            del self.env["DOCKER_HOST"]

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [*self.argv, *args], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"docker-compose {' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
            )
        return done

    def logctl(self, *args: str) -> str:
        """stdout of ``logctl ARGS`` run in the stack as the operator."""
        return self("run", "--rm", "-T", "logctl", *args).stdout

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compose]:
    if not _docker_answers():
        if os.environ.get("AGENTLOG_REQUIRE_DOCKER") == "1":
            pytest.fail("AGENTLOG_REQUIRE_DOCKER=1 but no Docker engine (and docker-compose) answers")
        pytest.skip("no Docker engine answers here")
    subprocess.run(
        [str(HERE / "build_images.sh")], env={**os.environ, "PYTHON": sys.executable}, check=True, timeout=1200
    )
    env_file = tmp_path_factory.mktemp("compose") / ".env"
    subprocess.run([str(REPO / "scripts" / "compose_env.sh"), str(env_file)], check=True, capture_output=True)
    stack = Compose(env_file, f"agentlogtest{uuid.uuid4().hex[:6]}")
    try:
        stack("up", "-d", "--no-build", timeout=600)
        yield stack
    finally:
        stack("down", "-v", "--remove-orphans", check=False, timeout=300)


def _sessions(stack: Compose) -> dict[str, dict[str, object]]:
    return {row["session_id"]: row for row in json.loads(stack.logctl("sessions", "--json"))}


def _wait_finished(stack: Compose, ids: set[str], deadline_s: float = 180) -> dict[str, dict[str, object]]:
    deadline = time.monotonic() + deadline_s
    rows: dict[str, dict[str, object]] = {}
    while time.monotonic() < deadline:
        rows = _sessions(stack)
        if all(rows.get(i, {}).get("status") == "finished" for i in ids):
            return rows
        time.sleep(2)
    raise AssertionError(f"sessions did not finish in {deadline_s:g} s: {rows}")


WORKERS = ("planner", "decider", "executor", "cache-manager", "engine-bridge", "projector", "console")


def _health(stack: Compose, service: str) -> str:
    inspected = subprocess.run(
        [DOCKER, "inspect", "--format", "{{.State.Health.Status}}", stack.container(service)],
        capture_output=True,
        text=True,
    )
    return inspected.stdout.strip()


def _metrics(stack: Compose, service: str) -> str:
    """The worker's /metrics, read inside its container (the port is not published)."""
    script = "import urllib.request; print(urllib.request.urlopen('http://localhost:9100/metrics').read().decode())"
    return stack("exec", "-T", service, "python3", "-c", script).stdout


def test_the_stack_runs_sessions_survives_worker_kills_and_pays_once(compose: Compose) -> None:
    stack = compose
    # Every worker reports itself healthy once it polls the log (its compose healthcheck).
    deadline = time.monotonic() + 180
    while (health := {s: _health(stack, s) for s in WORKERS}) != dict.fromkeys(WORKERS, "healthy"):
        assert time.monotonic() < deadline, f"workers not healthy: {health}"
        time.sleep(2)
    ran = json.loads(
        stack.logctl(
            "run", "script", "-n", "3", "--prefix", "ok", "--timeout", "120", "--json", "--args", json.dumps(ECHO)
        )
        .strip()
        .splitlines()[-1]
    )
    assert ran["finished"] == 3 and ran["llm_calls"] == 6 and ran["tool_calls"] == 3
    deadline = time.monotonic() + 60
    while 'agentlog_sessions{status="finished"} 3.0' not in (planner_metrics := _metrics(stack, "planner")):
        assert time.monotonic() < deadline, planner_metrics
        time.sleep(1)

    stack.logctl("run", "script", "-n", "1", "--prefix", "pay", "--no-wait", "--args", json.dumps(PAYMENT))
    stack.logctl("run", "script", "-n", "2", "--prefix", "more", "--no-wait", "--args", json.dumps(ECHO))
    # A crash: the executor's process SIGKILLed; its restart policy brings it back.
    executor = stack.container("executor")
    pid = subprocess.run([DOCKER, "inspect", "--format", "{{.State.Pid}}", executor], capture_output=True, text=True)
    os.kill(int(pid.stdout), 9)
    # A manual kill: docker kill of the planner (Docker does not restart it); started again as an operator would.
    subprocess.run([DOCKER, "kill", stack.container("planner")], check=True, capture_output=True)
    stack("up", "-d", "--no-build", "planner")

    deadline = time.monotonic() + 120
    while "pay-0000" not in _sessions(stack) or not _proposed(stack):
        assert time.monotonic() < deadline, "the payment was never proposed"
        time.sleep(2)
    stack.logctl("approve", "pay-0000", "tool-1")
    _wait_finished(stack, {"ok-0000", "ok-0001", "ok-0002", "pay-0000", "more-0000", "more-0001"})

    restarts = subprocess.run(
        [DOCKER, "inspect", "--format", "{{.RestartCount}}", executor], capture_output=True, text=True
    )
    assert int(restarts.stdout) >= 1, "the restart policy did not bring the executor back"
    paid = stack(
        "exec", "-T", "postgres", "psql", "-U", "agentlog", "-d", "agentlog", "-tAc",
        "SELECT count(*) FROM agentlog_ledger.payments WHERE session_id = 'pay-0000'",
    ).stdout.strip()  # fmt: skip
    assert paid == "1", f"the payment ran {paid} times"
    # The projector's read model (compose's Postgres) holds every session, finished.
    deadline = time.monotonic() + 60
    while (projected := _psql(stack, "SELECT count(*) FROM agentlog_read.sessions WHERE finished_at IS NOT NULL")) < 6:
        assert time.monotonic() < deadline, f"the read model has {projected} finished sessions of 6"
        time.sleep(2)
    assert _psql(stack, "SELECT count(*) FROM agentlog_read.tool_calls WHERE session_id = 'pay-0000'") == 1
    verified = stack("run", "--rm", "-T", "logctl", "verify")
    assert verified.returncode == 0 and "OK:" in verified.stdout, verified.stdout + verified.stderr


def _psql(stack: Compose, query: str) -> int:
    found = stack("exec", "-T", "postgres", "psql", "-U", "agentlog", "-d", "agentlog", "-tAc", query, check=False)
    return int(found.stdout.strip() or 0) if found.returncode == 0 else -1


def _proposed(stack: Compose) -> bool:
    """The payment's call is in the log (held for approval)."""
    replay = stack("run", "--rm", "-T", "logctl", "replay", "pay-0000", check=False)
    return "ToolCallProposed" in replay.stdout
