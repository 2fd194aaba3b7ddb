"""The SharedLog contract on the in-memory backend (no I/O: it runs with the unit tests)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from log.backend import Backend
from log.memory_backend import MemoryBackend, MemoryStore
from tests.contract.shared_log_contract import ReadOnlyAuditorContract, SharedLogContract

pytestmark = [pytest.mark.contract, pytest.mark.unit]


class TestMemorySharedLog(SharedLogContract, ReadOnlyAuditorContract):
    @pytest.fixture
    def make_backend(self) -> Callable[[], Backend]:
        store = MemoryStore()  # one log per test; every backend the test opens is a client of it
        return lambda: MemoryBackend(store)
