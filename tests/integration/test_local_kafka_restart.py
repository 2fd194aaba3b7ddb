"""The local broker starts again right after a crash, on the same port and data directory.

A SIGKILLed broker leaves its connections in TIME_WAIT on its port; Kafka binds with
SO_REUSEADDR, so they do not stop it, and the port check before the start must not either
(it refused such a restart for a minute). The broker here is the test's own (its own port
and data directory), never the shared one.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kafka.admin import KafkaAdminClient

from cli.common import ensure_topics
from log import open_log
from log.local_kafka import HOST, KafkaBrokerError, _check_free, _free_ports, _port_open
from schemas import events as ev

pytestmark = pytest.mark.integration


def _leave_time_wait() -> int:
    """A port with a connection in TIME_WAIT on it (its listener closed first, as a killed broker's)."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((HOST, 0))
    server.listen()
    port: int = server.getsockname()[1]
    client = socket.create_connection((HOST, port))
    accepted, _ = server.accept()
    accepted.close()  # the server's side closes first: TIME_WAIT stays on (HOST, port)
    server.close()
    client.close()
    return port


def test_the_port_check_lets_time_wait_by_and_refuses_a_listener() -> None:
    _check_free(_leave_time_wait())
    with socket.socket() as listener:
        listener.bind((HOST, 0))
        listener.listen()
        with pytest.raises(KafkaBrokerError, match="already in use"):
            _check_free(listener.getsockname()[1])


def _start(port: int, data_dir: Path, pid_file: Path) -> int:
    result = subprocess.run(
        [sys.executable, "-m", "log.local_kafka", "start", "--port", str(port), "--data-dir", str(data_dir),
         "--pid-file", str(pid_file)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"KAFKA_BOOTSTRAP_SERVERS={HOST}:{port}" in result.stdout
    return int(pid_file.read_text())


async def _append_and_read(url: str, session: str, expected: int) -> None:
    async with open_log(url, actor="planner", namespace="restart") as log:
        await log.append(session, ev.SessionStarted(program="script", args_json="{}"))
        history = await log.history(session, ["agent.actions"])
    assert [e.seq for e in history] == list(range(expected))


@pytest.mark.slow
def test_broker_restarts_at_once_after_a_sigkill(tmp_path: Path) -> None:
    (port,) = _free_ports(1)
    data_dir, pid_file = tmp_path / "kafka", tmp_path / "kafka.pid"
    url = f"kafka://{HOST}:{port}"
    pid = _start(port, data_dir, pid_file)
    try:
        ensure_topics(url, namespace="restart")
        asyncio.run(_append_and_read(url, "s-1", 1))
        # Clients still connected when it dies, as a stack's workers are: the dead broker's side of
        # each connection closes first, so it stays in TIME_WAIT on the broker's port.
        clients = [KafkaAdminClient(bootstrap_servers=f"{HOST}:{port}") for _ in range(2)]
        for client in clients:
            client.list_topics()  # a request answered: the broker accepted the connection
        os.kill(pid, signal.SIGKILL)
        while _port_open(port):  # its sockets close when its last thread is gone
            time.sleep(0.05)
        for client in clients:
            client.close()
        assert "TIME-WAIT" in subprocess.run(["ss", "-tan", f"sport = :{port}"], capture_output=True, text=True).stdout
        pid = _start(port, data_dir, pid_file)  # at once, on the same port and data directory
        asyncio.run(_append_and_read(url, "s-1", 2))
    finally:
        subprocess.run([sys.executable, "-m", "log.local_kafka", "stop", "--pid-file", str(pid_file)], timeout=60)


def test_the_ports_a_broker_picks_are_outside_the_ephemeral_range() -> None:
    """A killed broker must get its ports back: one in the ephemeral range may meanwhile be
    the local port of any outgoing connection (its own clients reconnecting included), and
    the restart is refused (a 200-session chaos run's broker stayed down so)."""
    low, _ = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = _free_ports(2)
    assert len(set(ports)) == 2
    assert all(p < low for p in ports), ports
    for port in ports:
        _check_free(port)


def test_an_outgoing_connections_local_port_refuses_a_broker_start_there() -> None:
    """Why: a port that the kernel gave a client as its local port is taken for the broker."""
    with socket.socket() as server:
        server.bind((HOST, 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            local_port = client.getsockname()[1]
            with pytest.raises(KafkaBrokerError, match="already in use"):
                _check_free(local_port)
