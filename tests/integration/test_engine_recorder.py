"""The engine recorder (workers/engines/recorder.py) as a real process, on real Postgres, in front
of agentlog's simulated engine: a request id already answered never reaches the engine again,
across a SIGKILL of the recorder, for concurrent duplicates and for streams; errors are not
recorded; bad input and an unreachable engine or database get a clear answer.

The simulated engine keeps its own record too; here it is the witness: its ``num_served``
counts what the recorder let through, and it must not move on a repeat.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cli.stack import free_port
from services.engine.record import RECORD_FIELD
from services.programs.base import Prompt
from workers.engines.http import HttpEngine

pytestmark = pytest.mark.integration

SECRET = "recorder-secret-pw-4711"


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return dict(json.load(response))


def _wait(url: str, process: subprocess.Popen[bytes], wait_s: float = 60) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{url}: the process exited {process.returncode}")
        try:
            _get(url)
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} did not answer in {wait_s} s")


@dataclass
class Recording:
    engine_url: str
    url: str
    args: list[str]
    process: subprocess.Popen[bytes]

    def engine_served(self) -> int:
        return int(_get(f"{self.engine_url}/stats")["num_served"])

    def stats(self) -> dict[str, Any]:
        return _get(f"{self.url}/recorder/stats")

    def restart_after_sigkill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)
        self.process = subprocess.Popen(self.args)
        _wait(f"{self.url}/recorder/stats", self.process)


@pytest.fixture
def recording(pg_url: str, namespace: str, tmp_path: Path) -> Iterator[Recording]:
    engine_port, port = free_port(), free_port()
    engine = subprocess.Popen(
        [sys.executable, "-m", "workers.engines.sim_server", "--port", str(engine_port), "--state-dir",
         str(tmp_path / "engine"), "--time-scale", "0.01"]
    )  # fmt: skip
    engine_url = f"http://127.0.0.1:{engine_port}"
    args = [sys.executable, "-m", "workers.engines.recorder", "--upstream", engine_url, "--port", str(port),
            "--record-url", pg_url, "--namespace", namespace]  # fmt: skip
    recorder = subprocess.Popen(args)
    try:
        _wait(f"{engine_url}/health", engine)
        _wait(f"http://127.0.0.1:{port}/recorder/stats", recorder)
        recording = Recording(engine_url, f"http://127.0.0.1:{port}", args, recorder)
        yield recording
    finally:
        for process in (recording.process if "recording" in locals() else recorder, engine):
            process.terminate()
            process.wait(10)


def _completion(rid: str) -> dict[str, Any]:
    return {"model": "sim", "prompt": f"say something about {rid}", "max_tokens": 8, "request_id": rid}


async def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body, headers=headers) as response:
        return response.status, await response.json(content_type=None)


def test_a_repeated_request_id_is_answered_from_the_record_even_after_a_sigkill(recording: Recording) -> None:
    url = f"{recording.url}/v1/completions"
    status, first = asyncio.run(_post(url, _completion("s1/llm-1")))
    assert status == 200 and RECORD_FIELD not in first
    assert recording.engine_served() == 1

    status, again = asyncio.run(_post(url, _completion("s1/llm-1")))
    assert status == 200 and again[RECORD_FIELD]["replayed"] is True
    assert again["choices"] == first["choices"] and again["usage"] == first["usage"]
    assert recording.engine_served() == 1

    recording.restart_after_sigkill()  # the record is in Postgres, not in the process
    status, after = asyncio.run(_post(url, _completion("s1/llm-1")))
    assert status == 200 and after["choices"] == first["choices"]
    assert recording.engine_served() == 1
    assert recording.stats()["replayed"] == 1  # this run of the recorder

    # The planner's engine client reports a replay as one.
    engine = HttpEngine(recording.url, engine_id="sim-0")

    async def complete() -> bool:
        try:
            done = await engine.complete(
                session_id="s1", request_id="s1/llm-1", prompt=Prompt(text="ignored"), max_output_tokens=8
            )
            return done.replayed
        finally:
            await engine.close()

    assert asyncio.run(complete()) is True
    assert recording.engine_served() == 1


def test_concurrent_duplicates_are_computed_once(recording: Recording) -> None:
    url = f"{recording.url}/v1/completions"

    async def burst() -> list[tuple[int, Any]]:
        return await asyncio.gather(*(_post(url, _completion("s2/llm-1")) for _ in range(6)))

    answers = asyncio.run(burst())
    assert [status for status, _ in answers] == [200] * 6
    assert len({json.dumps(body["choices"]) for _, body in answers}) == 1
    assert recording.engine_served() == 1
    assert recording.stats()["forwarded"] == 1


def test_a_stream_is_recorded_and_replayed_byte_for_byte(recording: Recording) -> None:
    body = {
        "model": "sim",
        "messages": [{"role": "user", "content": "stream me a few words"}],
        "max_completion_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def stream() -> bytes:
        headers = {"X-Request-Id": "s3/llm-1"}
        url = f"{recording.url}/v1/chat/completions"
        async with aiohttp.ClientSession() as http, http.post(url, json=body, headers=headers) as response:
            assert response.status == 200 and response.content_type == "text/event-stream"
            return await response.read()

    first = asyncio.run(stream())
    assert first.rstrip().endswith(b"data: [DONE]")
    assert recording.engine_served() == 1
    assert asyncio.run(stream()) == first
    assert recording.engine_served() == 1


def test_errors_and_unnamed_requests_are_not_recorded(recording: Recording) -> None:
    url = f"{recording.url}/v1/completions"
    chat = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "request_id": "s4/llm-1"}
    status, error = asyncio.run(_post(f"{recording.url}/v1/chat/completions", chat))
    assert status == 404 and "error" in error
    status, _ = asyncio.run(_post(url, _completion("s4/llm-1")))  # the same id, now valid: computed
    assert status == 200
    unnamed = {"model": "sim", "messages": [{"role": "user", "content": "no id"}], "max_completion_tokens": 4}
    for _ in range(2):
        status, _ = asyncio.run(_post(f"{recording.url}/v1/chat/completions", unnamed))
        assert status == 200
    assert recording.engine_served() == 3  # the valid named call once, the unnamed one twice
    assert recording.stats()["recorded"] == 1
    assert _get(f"{recording.url}/stats")["engine_id"] == "sim-0"  # other paths pass through


@pytest.mark.parametrize("rid", ["", "x" * 600, 5])
def test_a_request_id_that_cannot_name_a_call_is_a_400(recording: Recording, rid: object) -> None:
    status, error = asyncio.run(_post(f"{recording.url}/v1/completions", {**_completion("y"), "request_id": rid}))
    assert status == 400 and "request id" in error["error"]["message"]
    assert recording.engine_served() == 0


def test_an_unreachable_engine_is_a_502_and_nothing_is_recorded(pg_url: str, namespace: str) -> None:
    port = free_port()
    args = ["--upstream", f"http://127.0.0.1:{free_port()}", "--port", str(port), "--record-url", pg_url,
            "--namespace", namespace]  # fmt: skip
    recorder = subprocess.Popen([sys.executable, "-m", "workers.engines.recorder", *args])
    try:
        _wait(f"http://127.0.0.1:{port}/recorder/stats", recorder)
        status, error = asyncio.run(_post(f"http://127.0.0.1:{port}/v1/completions", _completion("z/llm-1")))
        assert status == 502 and error["error"]["type"] == "engine_unavailable"
        assert _get(f"http://127.0.0.1:{port}/recorder/stats")["recorded"] == 0
    finally:
        recorder.terminate()
        recorder.wait(10)


def test_an_unreachable_record_is_one_line_without_the_password() -> None:
    url = f"postgresql://agentlog:{SECRET}@127.0.0.1:{free_port()}/agentlog"
    done = subprocess.run(
        [sys.executable, "-m", "workers.engines.recorder", "--upstream", "http://127.0.0.1:1", "--port",
         str(free_port()), "--record-url", url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert SECRET not in output
    assert "Traceback" not in output
    assert "recorder: cannot start" in done.stderr.strip().splitlines()[-1]
