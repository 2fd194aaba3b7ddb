"""The shared log: codec, hash chains, the SharedLog interface, its backends, the consumer API.

Typical use::

    from log import open_log
    from log.topics import AGENT_ACTIONS
    async with open_log("kafka://127.0.0.1:9092", actor="planner") as log:
        await log.append(session_id, SessionStarted(program="trace", args_json="{}"))

    async with open_log(url, actor="auditor") as log, log.consumer("audit", [AGENT_ACTIONS.name]) as events:
        for event in await events.poll():
            ...
        await events.commit()
"""

from log.backend import Backend
from log.codec import Codec
from log.consumer import EventConsumer
from log.errors import (
    ActorNotAllowed,
    AgentLogError,
    BackendUnavailable,
    BadMagic,
    BodyNotAllowed,
    BrokenChain,
    ConcurrentWriter,
    DecodeError,
    DuplicateVerdict,
    HashMismatch,
    IntegrityError,
    KeyMismatch,
    NotTopicOwner,
    ProtocolViolation,
    RecordError,
    RetryableError,
    SchemaMismatch,
    SeqGap,
    SeqRepeat,
    TruncatedRecord,
    UnknownFingerprint,
    UnknownSession,
    UnknownTopic,
    UnsupportedLogUrl,
)
from log.gc_tuning import GC_THRESHOLDS, tune_gc
from log.shared_log import SharedLog
from log.topics import TOPICS, Topic
from log.types import Clock, Draft, LoggedEvent, Position, RawRecord, system_clock
from log.urls import backend_for, open_log

__all__ = [
    "GC_THRESHOLDS",
    "TOPICS",
    "ActorNotAllowed",
    "AgentLogError",
    "Backend",
    "BackendUnavailable",
    "BadMagic",
    "BodyNotAllowed",
    "BrokenChain",
    "Clock",
    "Codec",
    "ConcurrentWriter",
    "DecodeError",
    "Draft",
    "DuplicateVerdict",
    "EventConsumer",
    "HashMismatch",
    "IntegrityError",
    "KeyMismatch",
    "LoggedEvent",
    "NotTopicOwner",
    "Position",
    "ProtocolViolation",
    "RawRecord",
    "RecordError",
    "RetryableError",
    "SchemaMismatch",
    "SeqGap",
    "SeqRepeat",
    "SharedLog",
    "Topic",
    "TruncatedRecord",
    "UnknownFingerprint",
    "UnknownSession",
    "UnknownTopic",
    "UnsupportedLogUrl",
    "backend_for",
    "open_log",
    "system_clock",
    "tune_gc",
]
