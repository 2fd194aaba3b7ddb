"""The envelope's head read in one pass, and a usual record read whole: the part of
``log.codec``'s decode that every record pays.

``read_record`` reads a whole record in one call where nothing about it is unusual: the
header, the head, the body (with the reader ``log.codec`` hands it) and the hash, checked.
Anything else returns None, and ``log.codec`` reads the record step by step, which fails
with the error that fits.

``read_head`` reads the seven fields before the body (event_id, session_id, seq, actor,
occurred_at, causation_id, prev_hash) and the body's union branch of a record written with
the current schema, or returns None for anything unusual, which ``log.codec`` then reads
field by field as fastavro does. ``read_long`` is Avro's varint as fastavro reads it.

``read_envelope`` is ``read_record`` with the body and the envelope built as the pydantic
models they are (``construct``), for ``log.codec``'s decode: building them here, compiled,
costs about a third of a microsecond a record less than in ``log.codec``.

Bytes-to-values code with no imports of the project (pydantic's ``BaseModel`` only), so that
``scripts/compile_native.py`` can compile it with mypyc (``log.native``); it runs as it is
where that was not built.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel

__all__ = [
    "HEAD_START",
    "Built",
    "Head",
    "Record",
    "build_envelope",
    "construct",
    "read_envelope",
    "read_head",
    "read_long",
    "read_record",
]

HEAD_START = 10
"""Where the head begins: after the 2 magic bytes and the 8-byte fingerprint (``log.codec.HEADER_LEN``)."""

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

Head = tuple[str, str, int, str, datetime, str | None, bytes, int, int]
"""event_id, session_id, seq, actor, occurred_at, causation_id, prev_hash, the body's union
branch and the position of the body."""


Record = tuple[str, str, int, str, datetime, str | None, bytes, int, dict[str, Any], bytes]
"""``Head`` without the body's position, then the body's values and the stored hash."""

HASH_PREFIX = 0x40
"""The hash field's length byte: the zig-zag varint of 32 (``log.codec._HASH_PREFIX``)."""
HASH_TAIL_LEN = 33
"""The hash field: its length byte and 32 bytes (``log.codec._HASH_TAIL_LEN``)."""


def read_long(data: bytes, pos: int) -> tuple[int, int]:
    """The long at ``pos`` and the position after it."""
    try:
        b = data[pos]
    except IndexError:
        raise EOFError("no bytes left for a long") from None
    if b < 0x80:  # one byte: every small number, length and union index
        return (b >> 1) ^ -(b & 1), pos + 1
    n = b & 0x7F
    shift = 7
    while True:
        pos += 1
        b = data[pos]
        n |= (b & 0x7F) << shift
        if b < 0x80:
            break
        shift += 7
        if shift >= 70:
            # No Avro writer emits more than 10 bytes for a long; fastavro's C reader gives
            # such input an undefined meaning. Refuse it rather than guess.
            raise ValueError("varint longer than 10 bytes")
    n &= 0xFFFF_FFFF_FFFF_FFFF  # a long has 64 bits, as in fastavro's reader
    return (n >> 1) ^ -(n & 1), pos + 1


def read_head(data: bytes) -> Head | None:
    """The head of a well-formed record in one pass, or None for anything unusual.

    What every record written here looks like: each string and the prev_hash shorter
    than 64 bytes (a one-byte length), the causation branch 0 or 1, the body branch
    under 64. Anything else (a long string, a forged length past the end, bad UTF-8, a
    truncated record) returns None and the record takes ``log.codec``'s field-by-field reading, which fails
    the way fastavro does: this function never accepts what ``log.codec``'s field-by-field
    reading would read differently, and raises only ``EOFError``, for a record that ends
    inside its timestamp (both callers catch it). About half the cost of the field by
    field reading (a function call and a tuple per field).
    """
    end = len(data)
    causation_id: str | None
    try:
        p = HEAD_START
        n = data[p]  # event_id: a one-byte, even (non-negative) zig-zag length
        if n & 0x81:
            return None
        q = p + 1 + (n >> 1)
        if q > end:
            return None
        event_id = data[p + 1 : q].decode()
        n = data[q]  # session_id
        if n & 0x81:
            return None
        p = q + 1 + (n >> 1)
        if p > end:
            return None
        session_id = data[q + 1 : p].decode()
        n = data[p]  # seq
        if n < 0x80:
            seq = (n >> 1) ^ -(n & 1)
            p += 1
        else:
            seq, p = read_long(data, p)
        n = data[p]  # actor
        if n & 0x81:
            return None
        q = p + 1 + (n >> 1)
        if q > end:
            return None
        actor = data[p + 1 : q].decode()
        micros, p = read_long(data, q)
        occurred_at = EPOCH + timedelta(0, 0, micros)  # positional: a keyword costs a third more
        n = data[p]  # causation_id: branch 0 (null) or 1 (string)
        if n == 0:
            causation_id = None
            p += 1
        elif n == 2:
            n = data[p + 1]
            if n & 0x81:
                return None
            q = p + 2 + (n >> 1)
            if q > end:
                return None
            causation_id = data[p + 2 : q].decode()
            p = q
        else:
            return None
        n = data[p]  # prev_hash
        if n & 0x81:
            return None
        q = p + 1 + (n >> 1)
        if q > end:
            return None
        prev_hash = data[p + 1 : q]
        n = data[q]  # the body's branch
        if n & 0x81:
            return None
        return event_id, session_id, seq, actor, occurred_at, causation_id, prev_hash, n >> 1, q + 1
    except (IndexError, ValueError, OverflowError):  # UnicodeDecodeError is a ValueError
        return None


def read_record(data: bytes, header: bytes, readers: list[Any]) -> Record | None:
    """A whole record in one call, or None for anything unusual (module docstring).

    ``header``: the magic bytes and the current schema's fingerprint; ``readers``: per body
    branch, a ``log.body_reader`` reader whose values need no validation, or None. Returns
    the record only if it starts with ``header``, its head and body read without surprise,
    the hash field ends it and the hash matches what it covers: exactly what ``log.codec``'s
    step-by-step reading returns for such a record. One call instead of a dozen, which is
    what is left of decoding's cost once the readers are compiled.
    """
    if data[:HEAD_START] != header:
        return None
    try:
        head = read_head(data)  # may raise EOFError (a truncated timestamp)
        if head is None:
            return None
        event_id, session_id, seq, actor, occurred_at, causation_id, prev_hash, branch, pos = head
        reader = readers[branch] if branch < len(readers) else None
        if reader is None:
            return None
        values, pos = reader(data, pos)
    except Exception:  # what such a record is (and which error) is log.codec's to say
        return None
    if pos + HASH_TAIL_LEN != len(data) or data[pos] != HASH_PREFIX:
        return None
    stored_hash = data[pos + 1 :]
    if hashlib.sha256(data[HEAD_START:pos]).digest() != stored_hash:
        return None
    return event_id, session_id, seq, actor, occurred_at, causation_id, prev_hash, branch, values, stored_hash


# The setters of the four slots every pydantic model instance has, called directly: faster
# than ``object.__setattr__`` by name.
_new_instance = object.__new__
_set_dict = BaseModel.__dict__["__dict__"].__set__
_set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__

Built = tuple[Any, set[str]]
"""A model ``construct`` builds, and the set of its field names its instances share."""


def construct(model: Any, values: dict[str, Any], fields_set: set[str]) -> Any:
    """What ``model.model_construct(**values)`` returns when ``values`` holds every field in
    order, and ``fields_set`` is the set of the model's field names (``log.codec._construct``
    says when a model may be built so)."""
    instance = _new_instance(model)
    _set_dict(instance, values)
    _set_fields_set(instance, fields_set)
    _set_extra(instance, None)
    _set_private(instance, None)
    return instance


def read_envelope(data: bytes, header: bytes, readers: list[Any], bodies: list[Built], envelope: Built) -> Any:
    """``read_record``'s record as the envelope model it is, or None where that returns None.

    ``bodies``: per body branch, its model (those ``readers`` read are built as read);
    ``envelope``: the envelope's model, whose fields are the record's in order."""
    record = read_record(data, header, readers)
    if record is None:
        return None
    event_id, session_id, seq, actor, occurred_at, causation_id, prev_hash, branch, values, stored_hash = record
    model, fields_set = bodies[branch]
    body = construct(model, values, fields_set)
    return build_envelope(
        envelope, event_id, session_id, seq, actor, occurred_at, causation_id, prev_hash, body, stored_hash
    )


def build_envelope(
    envelope: Built,
    event_id: str,
    session_id: str,
    seq: int,
    actor: str,
    occurred_at: datetime,
    causation_id: str | None,
    prev_hash: bytes,
    body: Any,
    stored_hash: bytes,
) -> Any:
    """The envelope model ``envelope`` of fields a decoder has read and typed itself (``construct``)."""
    model, fields_set = envelope
    return construct(
        model,
        {
            "event_id": event_id,
            "session_id": session_id,
            "seq": seq,
            "actor": actor,
            "occurred_at": occurred_at,
            "causation_id": causation_id,
            "prev_hash": prev_hash,
            "body": body,
            "hash": stored_hash,
        },
        fields_set,
    )
