"""Which partition a session lives in: Kafka's default (murmur2) so every client agrees."""

from __future__ import annotations

from functools import lru_cache

from kafka.partitioner.default import murmur2


# kafka-python's murmur2 is pure Python (microseconds per call) and every append, and every
# consumer that rebuilds a partition, asks again for the same live sessions: remember the
# answers. Bounded, so a long-lived writer that sees millions of sessions stays small.
@lru_cache(maxsize=65536)
def partition_for(session_id: str, num_partitions: int) -> int:
    """The partition of ``session_id``, as Kafka's Java and Python clients compute it for that key."""
    hashed: int = murmur2(session_id.encode())
    return (hashed & 0x7FFFFFFF) % num_partitions
