"""Which partition a session lives in: Kafka's default (murmur2) so every client agrees."""

from __future__ import annotations

from kafka.partitioner.default import murmur2


def partition_for(session_id: str, num_partitions: int) -> int:
    """The partition of ``session_id``, as Kafka's Java and Python clients compute it for that key."""
    hashed: int = murmur2(session_id.encode())
    return (hashed & 0x7FFFFFFF) % num_partitions
