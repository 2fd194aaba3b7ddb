"""What the Kafka group tests share: a session in every partition."""

from __future__ import annotations

from log.shared_log import SharedLog


def one_session_per_partition(log: SharedLog, suffix: str) -> dict[int, str]:
    """A session id in each partition of ``log`` (partition -> id): whichever partitions move, some
    session is in one."""
    sessions: dict[int, str] = {}
    i = 0
    while len(sessions) < log.num_partitions:
        sessions.setdefault(log.partition_for(f"s{i}-{suffix}"), f"s{i}-{suffix}")
        i += 1
    return sessions
