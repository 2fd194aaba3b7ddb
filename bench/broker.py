"""The Kafka broker a benchmark runs against: the one it is given, else one of its own.

``--bootstrap HOST:PORT``, else ``$KAFKA_BOOTSTRAP_SERVERS``, else a local broker started
from the Maven jars for the benchmark's duration (``log.local_kafka``): a Kafka row is never
skipped for want of a broker, so the command a goal names measures what the goal is about.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from log.local_kafka import LocalKafkaBroker


def given_address(bootstrap: str | None) -> str | None:
    """``bootstrap``, else ``$KAFKA_BOOTSTRAP_SERVERS``, else None."""
    return bootstrap or os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or None


@contextlib.contextmanager
def broker_address(bootstrap: str | None) -> Iterator[str]:
    """The given broker's address, else a local broker's for the duration."""
    address = given_address(bootstrap)
    if address:
        yield address
        return
    print("starting a local Kafka broker ...", file=sys.stderr, flush=True)
    with LocalKafkaBroker() as broker:
        yield broker.bootstrap_servers
