"""Starting a partition late, on the Kafka backend's librdkafka client."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from log.backend import Backend
from log.rdkafka_backend import RdKafkaBackend
from tests.contract.shared_log_contract import SharedLogContract
from tests.contract.start_at_contract import StartAtContract

pytestmark = [pytest.mark.contract, pytest.mark.integration]


class TestRdKafkaStartAt(StartAtContract):
    run = SharedLogContract.run

    @pytest.fixture
    def make_backend(self, kafka_bootstrap: str, namespace: str) -> Callable[[], Backend]:
        return lambda: RdKafkaBackend(kafka_bootstrap, namespace=namespace)
