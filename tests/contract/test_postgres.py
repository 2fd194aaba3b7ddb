"""The SharedLog contract on the Postgres backend (the embedded default)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from log.backend import Backend
from log.postgres_backend import PostgresBackend
from tests.contract.shared_log_contract import ReadOnlyAuditorContract, SharedLogContract

pytestmark = [pytest.mark.contract, pytest.mark.integration]


class TestPostgresSharedLog(SharedLogContract, ReadOnlyAuditorContract):
    @pytest.fixture
    def make_backend(self, pg_url: str, namespace: str) -> Callable[[], Backend]:
        return lambda: PostgresBackend(pg_url, namespace=namespace)
