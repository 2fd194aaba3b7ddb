"""A kafka-python log's close closes every client it opened, even when its caller gives up.

The CI-sized chaos test held every invariant and pytest still failed it on unclosed AF_UNIX
sockets (kafka-python's wakeup socket pairs): the operator gives each round 30 s
(``wait_for``) while the broker may be paused, and a close cancelled while the producer
flushed never reached the scan consumers after it; and a scan whose generator is finalized
after its log was closed handed its consumer back to the pool of a closed backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from cli.common import ensure_topics
from log import open_log
from log.shared_log import SharedLog
from log.topics import AGENT_ACTIONS
from schemas.events import SessionRequested

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def kafka_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """These are kafka-python's clients (``log.kafka_backend``), whatever the environment chooses."""
    monkeypatch.setenv("AGENTLOG_KAFKA_CLIENT", "python")


async def closed(client: Any, within_s: float = 30.0) -> bool:
    """Whether a kafka-python client is closed by now or soon (a thread may be closing it)."""
    deadline = time.monotonic() + within_s
    while not client._closed and time.monotonic() < deadline:  # noqa: ASYNC110 - a thread sets it
        await asyncio.sleep(0.05)
    return bool(client._closed)


async def scanners(log: SharedLog, n: int) -> list[Any]:
    """Make the backend pool ``n`` scan consumers (``n`` scans at once)."""
    await asyncio.gather(*(log.backend.end_offsets(AGENT_ACTIONS.name) for _ in range(n)))
    pooled = list(log.backend._scanners)  # type: ignore[attr-defined]
    assert len(pooled) == n
    return pooled


def test_a_close_given_up_on_still_closes_every_scan_consumer(kafka_bootstrap: str, namespace: str) -> None:
    url = f"kafka://{kafka_bootstrap}"
    ensure_topics(url, namespace=namespace)

    async def main() -> None:
        log = await open_log(url, actor="operator", namespace=namespace).start()
        pooled = await scanners(log, 2)
        closing = asyncio.create_task(log.close())
        await asyncio.sleep(0)  # inside the producer's close now
        closing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await closing
        assert [await closed(s) for s in pooled] == [True, True]

    asyncio.run(main())


def test_a_scan_finalized_after_its_log_closed_closes_its_consumer(kafka_bootstrap: str, namespace: str) -> None:
    url = f"kafka://{kafka_bootstrap}"
    ensure_topics(url, namespace=namespace)

    async def main() -> None:
        async with open_log(url, actor="operator", namespace=namespace) as log:
            position = await log.append("s-1", SessionRequested(program="p", args_json="{}", author="me"))
            scan = log.backend.scan(position.topic, position.partition)
            await scan.__anext__()  # a reader that stopped after one record; its generator lives on
            scanner = scan.ag_frame.f_locals["scanner"]  # type: ignore[attr-defined]
        await scan.aclose()  # finalized after the log closed: hands the consumer back
        assert await closed(scanner)

    asyncio.run(main())
