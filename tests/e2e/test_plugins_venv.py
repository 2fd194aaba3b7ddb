"""Plugins installed as a package: the example agent, its tools and its voter from entry points.

A temporary virtualenv gets the project's dependencies by reference (a ``.pth``
file: no download, works offline) and a small package (a wheel built here, so
no build backend is needed), installed with pip, whose entry points (``agentlog.programs``, ``agentlog.tools``,
``agentlog.voters``) name the example's objects. ``logctl up`` from that
virtualenv, in a folder where the example is not importable, starts a stack
whose every process finds them; ``logctl run`` starts the agent; it finishes.
Then each bad plugin stops ``logctl up`` or a worker at start-up with its
one-line message.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
import uuid
import zipfile
from pathlib import Path

import pytest

from cli.stack import Stack
from schemas import events as ev
from tests.e2e.sdk_scenario import GOAL, SdkScenario

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def make_venv(tmp: Path) -> Path:
    """A virtualenv that sees this project's installed dependencies (and the project) by reference."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]  # this project's environment: its .pth files make the project importable
    Path(purelib, "agentlog_deps.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    return python


def wheel(tmp: Path, name: str, files: dict[str, str], entry_points: dict[str, dict[str, str]]) -> Path:
    """A pure-Python wheel (the format pip installs offline, without a build backend)."""
    dist = f"{name.replace('-', '_')}-0.1.0"
    entries = "".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()) + "\n"
        for group, points in entry_points.items()
    )
    contents = {
        **files,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist}.dist-info/entry_points.txt": entries,
    }
    record = []
    path = tmp / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in contents.items():
            data = text.encode()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{member},sha256={digest},{len(data)}")
            archive.writestr(member, data)
        archive.writestr(f"{dist}.dist-info/RECORD", "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n")
    return path


def install(python: Path, wheel_file: Path) -> None:
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel_file)],
        check=True,
        capture_output=True,
    )


def travel_package(tmp: Path) -> Path:
    """The example's module as package ``travel_plugin``, its objects as entry points."""
    target = "travel_plugin.agent"
    return wheel(
        tmp,
        "agentlog-travel-plugin",
        {
            "travel_plugin/__init__.py": "",
            "travel_plugin/agent.py": (ROOT / "examples" / "travel_agent" / "agent.py").read_text(),
        },
        {
            "agentlog.programs": {"travel_agent": f"{target}:travel_agent"},
            "agentlog.tools": {t: f"{target}:{t}" for t in ("search_flights", "quote_hotel", "book_flight")},
            "agentlog.voters": {"budget_guard": f"{target}:budget_guard"},
        },
    )


def broken_package(tmp: Path) -> Path:
    """An entry point that names an attribute its module does not have."""
    return wheel(
        tmp,
        "agentlog-broken-plugin",
        {"broken_plugin/__init__.py": ""},
        {"agentlog.tools": {"oops": "broken_plugin:missing"}},
    )


BAD_MODULES = {
    "import_error": "raise RuntimeError('the fares API key is not set')\n",
    "bad_schema": "from services.sdk import tool\n"
    "t = tool(name='t', effect='pure', schema={'type': 'object', 'required': 'q'})(print)\n",
    "duplicate": "from services.sdk import tool\nsearch_flights = tool(name='search_flights', effect='pure')(print)\n",
}


def test_plugins_from_entry_points_run_under_logctl_up_and_bad_ones_stop_it(
    kafka_bootstrap: str, namespace: str, pg_url: str, tmp_path: Path
) -> None:
    python = make_venv(tmp_path)
    install(python, travel_package(tmp_path))
    outside = tmp_path / "elsewhere"  # not the checkout: the example is importable only as the package
    outside.mkdir()
    log_url = f"kafka://{kafka_bootstrap}"
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTLOG_PLUGINS", "PYTHONPATH")}
    env |= {
        "AGENTLOG_NAMESPACE": namespace,
        "AGENTLOG_LEDGER_URL": pg_url,
        "AGENTLOG_VOTERS": "default,llm_judge",
        "AGENTLOG_LOG_URL": log_url,
    }
    work = tmp_path / "stack"

    def logctl(*argv: str, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(python), "-m", "cli.main", *argv], cwd=outside, env=env | (extra or {}), capture_output=True, text=True
        )

    up_log = tmp_path / "up.log"
    with up_log.open("w") as out:
        up = subprocess.Popen(
            [str(python), "-m", "cli.main", "up", "--insecure", "--work-dir", str(work)],
            cwd=outside,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        while "running; Ctrl-C to stop" not in up_log.read_text():
            assert up.poll() is None, up_log.read_text()
            time.sleep(0.2)
        scenario = SdkScenario(kafka_bootstrap, namespace, pg_url, work, num_sessions=1)
        scenario.stack = Stack(log_url, work)  # the processes belong to logctl up: nothing to restart here
        session = f"pkg-{uuid.uuid4().hex[:4]}"
        args = json.dumps({"goal": GOAL, "to": "LIS", "budget_cents": 10**6})
        started = logctl("run", "travel_agent", "--args", args, "--prefix", session, "--no-wait")
        assert started.returncode == 0, started.stdout + started.stderr
        session = f"{session}-0000"
        scenario.sessions = [session]
        wanted = [session, *(f"{session}.fork-3.{i}" for i in range(2))]
        book, _ = scenario.drive(wanted, deadline_s=120)
        state = book.records[session].state
        assert state.status is not None and state.status.value == "finished", state.failure
        assert json.loads(state.output_json or "")["booking"]["confirmation"].startswith("BK-")
        booking = state.tool_calls["tool-4"]
        assert isinstance(booking.verdict, ev.ToolCallCommitted)
        assert {v.voter for v in booking.verdict.votes} >= {"budget_guard", "llm_judge", "human_approval"}
        assert [b["key"] for b in scenario.bookings()] == [f"{session}/tool-4"]
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()

    # ---------------------------------------------------------------- bad plugins
    bad = tmp_path / "badmods"
    bad.mkdir()
    for name, text in BAD_MODULES.items():
        (bad / f"{name}.py").write_text(textwrap.dedent(text))
    with_bad = {"PYTHONPATH": str(bad)}
    cases = [
        (["up", "--insecure", "--plugins", "no_such_module"], None,
         "logctl: error: plugin no_such_module: no such module"),
        (["up", "--insecure", "--plugins", "import_error"], with_bad,
         "logctl: error: plugin import_error: cannot be imported: RuntimeError: the fares API key is not set"),
        (["run", "travel_agent", "--plugins", "bad_schema:t"], with_bad,
         "logctl: error: plugin bad_schema:t: tool 't' has an argument schema that is not a valid JSON schema"),
        (["up", "--insecure", "--plugins", "duplicate"], with_bad,
         "logctl: error: plugin duplicate: tool 'search_flights' is registered twice (already by "
         "travel_plugin.agent:search_flights (entry point agentlog.tools:search_flights))"),
        (["up", "--insecure", "--plugins", "bad_schema:nope"], with_bad,
         "logctl: error: plugin bad_schema:nope: module bad_schema has no attribute 'nope'"),
    ]  # fmt: skip
    for argv, extra, message in cases:
        result = logctl(*argv, extra=extra)
        assert result.returncode == 2, (argv, result.stdout, result.stderr)
        assert result.stderr.strip().splitlines()[-1].startswith(message), (argv, result.stderr)
    for role, plugins, message in [
        ("planner", "import_error", "plugin import_error: cannot be imported: RuntimeError"),
        ("executor", "bad_schema", "plugin bad_schema: tool 't' has an argument schema that is not a valid JSON"),
    ]:
        result = subprocess.run(
            [str(python), "-m", f"workers.{role}"],
            cwd=outside,
            env=env | with_bad | {"AGENTLOG_PLUGINS": plugins},
            capture_output=True,
            text=True,
        )
        assert result.returncode == 2, (role, result.stderr)
        assert (
            result.stderr.strip() == f"python -m workers.{role}: error: {message}"
            or result.stderr.strip().startswith(f"python -m workers.{role}: error: {message}")
        ), result.stderr
    install(python, broken_package(tmp_path))  # an installed package with an entry point that does not load
    result = subprocess.run(
        [str(python), "-m", "workers.decider"], cwd=outside, env=env, capture_output=True, text=True
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().startswith(
        "python -m workers.decider: error: plugin broken_plugin:missing (entry point agentlog.tools:oops): "
        "cannot be loaded: AttributeError"
    ), result.stderr
