"""Starting a partition late, on the Postgres backend."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from log.backend import Backend
from log.postgres_backend import PostgresBackend
from tests.contract.shared_log_contract import SharedLogContract
from tests.contract.start_at_contract import StartAtContract

pytestmark = [pytest.mark.contract, pytest.mark.integration]


class TestPostgresStartAt(StartAtContract):
    run = SharedLogContract.run

    @pytest.fixture
    def make_backend(self, pg_url: str, namespace: str) -> Callable[[], Backend]:
        return lambda: PostgresBackend(pg_url, namespace=namespace)
