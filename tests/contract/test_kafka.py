"""The SharedLog contract on the Kafka backend (a real broker)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from log.backend import Backend
from log.kafka_backend import KafkaBackend
from tests.contract.shared_log_contract import ReadOnlyAuditorContract, SharedLogContract

pytestmark = [pytest.mark.contract, pytest.mark.integration]


class TestKafkaSharedLog(SharedLogContract, ReadOnlyAuditorContract):
    @pytest.fixture
    def make_backend(self, kafka_bootstrap: str, namespace: str) -> Callable[[], Backend]:
        return lambda: KafkaBackend(kafka_bootstrap, namespace=namespace)
