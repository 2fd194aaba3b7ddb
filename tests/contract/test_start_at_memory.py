"""Starting a partition late, on the in-memory backend."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from log.backend import Backend
from log.memory_backend import MemoryBackend, MemoryStore
from tests.contract.shared_log_contract import SharedLogContract
from tests.contract.start_at_contract import StartAtContract

pytestmark = [pytest.mark.contract, pytest.mark.unit]


class TestMemoryStartAt(StartAtContract):
    run = SharedLogContract.run

    @pytest.fixture
    def make_backend(self) -> Callable[[], Backend]:
        store = MemoryStore()
        return lambda: MemoryBackend(store)
