"""workers.main.run_worker: what every worker process is started with."""

from __future__ import annotations

import gc
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest

import workers.main
from log import GC_THRESHOLDS
from workers.decider import DeciderWorker

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _restore_thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_a_worker_runs_with_the_consumers_collector_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int, int]] = []

    def run(main: Coroutine[Any, Any, None]) -> None:
        main.close()  # the worker itself is not started: only what it would run under
        seen.append(gc.get_threshold())

    monkeypatch.setattr(workers.main.asyncio, "run", run)
    monkeypatch.setattr(workers.main, "configure_logging", lambda *args: None)
    gc.set_threshold(700, 10, 10)
    workers.main.run_worker(DeciderWorker, ["--log-url", "memory:gc"])
    assert seen == [GC_THRESHOLDS]
