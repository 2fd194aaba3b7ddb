"""Every exception the log raises, in one tree.

``RecordError`` and its subclasses describe one bad record: consumers route it
to ``agent.dlq`` with ``str(error)`` as the reason and carry on. The rest are
about the caller or the backend; ``RetryableError`` marks the ones worth
trying again.
"""

from __future__ import annotations


class AgentLogError(Exception):
    """Base of every error raised by the log."""


class RecordError(AgentLogError):
    """A record that cannot be trusted. Consumers dead-letter it and continue."""


# ---------------------------------------------------------------- decoding


class DecodeError(RecordError):
    """The bytes are not a record of ours."""


class BadMagic(DecodeError):
    """The record does not start with the Avro single-object marker C3 01."""


class UnknownFingerprint(DecodeError):
    """The record names a writer schema that is not in schemas/releases."""


class TruncatedRecord(DecodeError):
    """The record ends before its schema says it should."""


class SchemaMismatch(DecodeError):
    """The bytes do not decode with the writer schema, or do not resolve to the reader schema."""


# --------------------------------------------------------------- integrity


class IntegrityError(RecordError):
    """The record decodes, but breaks a rule of the log."""


class HashMismatch(IntegrityError):
    """The record's hash does not cover its own bytes: it was altered after it was written."""


class BrokenChain(IntegrityError):
    """The record's prev_hash is not the hash of the previous record of its session."""


class SeqGap(IntegrityError):
    """The record's seq skips ahead of the next expected seq of its session."""


class SeqRepeat(IntegrityError):
    """The record's seq was already used in its session (a duplicate or a replay)."""


class ActorNotAllowed(IntegrityError):
    """The record's actor does not own the topic it was written to."""


class BodyNotAllowed(IntegrityError):
    """The record's body type does not belong on the topic it was written to."""


class KeyMismatch(IntegrityError):
    """The record's key is not its session_id."""


class ProtocolViolation(RecordError):
    """The record is sound on the wire but breaks the protocol between roles (found by a worker)."""


class UnknownSession(ProtocolViolation):
    """An event for a session that was never requested or started."""


class DuplicateVerdict(ProtocolViolation):
    """A second verdict for a tool call that already has one; the first one stands."""


# ----------------------------------------------------------------- callers


class NotTopicOwner(AgentLogError):
    """This writer's actor may not append to that topic (checked before anything is sent)."""


class UnknownTopic(AgentLogError):
    """The topic is not one of the log's topics (see log.topics)."""


class UnsupportedLogUrl(AgentLogError, ValueError):
    """The log URL names no backend (see log.urls)."""


class RetryableError(AgentLogError):
    """A transient failure: the same call may succeed later."""


class ConcurrentWriter(RetryableError):
    """Another writer appended to the same (topic, session) first; state was reloaded, retry."""


class BackendUnavailable(RetryableError):
    """The broker or database could not be reached."""
