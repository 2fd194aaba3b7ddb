"""Avro binary writers for a record's envelope head and flat event bodies; the body
writers are built once per body type from its schema.

``fastavro.schemaless_writer`` costs several microseconds per call before it writes
a byte (it re-checks the parsed schema and builds its options for every record, and
picks each union branch by validating the value against every branch), which made it
half of ``Codec.encode``: more than the envelope head, the hash and the chain
bookkeeping together. The bodies the log writes are records of a few scalars, so a
writer made of one small function per field, joined, does the same work in a
fraction of that.

Exactly fastavro's bytes, or nothing: a writer handles only the value types a
validated body holds (``str`` for a string, ``int`` for a long, ``float`` for a
double, a member of the enum, ``None`` or the one other branch of a ``["null", T]``
union, lists and ``str``-keyed dicts of those). On any other value, or any error,
it raises, and ``log.codec`` writes that body with fastavro instead, which then
decides what the value means or which error it is. A schema with any other type
(nested records, named references, logical types, other unions) gets no writer
at all. ``tests/unit/log/test_codec_fast_path.py`` checks every event type and
generated bodies byte for byte against fastavro's generic writer.

``write_head`` writes the envelope's fields before the body, which ``log.codec`` encodes by
hand (its layout is in that module's docstring). ``make install`` compiles this module
with mypyc, as it does the readers (``log.native``): an append spends about half of its
own time here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

__all__ = ["MAX_LONG", "MIN_LONG", "BodyWriter", "Unusual", "body_writer", "varint", "write_head"]

BodyWriter = Callable[[dict[str, Any]], bytes]
"""A body's field values (its ``__dict__``) to the Avro binary encoding of the record."""

_FieldWriter = Callable[[Any], bytes]

MIN_LONG, MAX_LONG = -(1 << 63), (1 << 63) - 1
_MIN_INT, _MAX_INT = -(1 << 31), (1 << 31) - 1
_ONE_BYTE = tuple(bytes([i]) for i in range(0x80))
_pack_double = struct.Struct("<d").pack


class Unusual(Exception):
    """A value this module does not write (fastavro writes it, or refuses it)."""


def varint(n: int) -> bytes:
    """Avro's zig-zag varint of a long known to fit in 64 bits."""
    z = (n << 1) ^ (n >> 63)
    if z < 0x80:
        return _ONE_BYTE[z]
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _long_in_range(n: int) -> bytes:
    if not MIN_LONG <= n <= MAX_LONG:
        raise OverflowError(f"{n} does not fit in an Avro long (64 bits)")  # fastavro refuses it too
    return varint(n)


def _text(value: str) -> bytes:
    data = str.encode(value)  # unlike value.encode(), a TypeError for a non-str, as fastavro's
    return varint(len(data)) + data


def write_head(
    header: bytes,
    event_id: str,
    session_id: str,
    seq: int,
    actor: str,
    micros: int,
    causation_id: str | None,
    prev_hash: bytes,
    branch: bytes,
) -> bytes:
    """The record up to its body: ``header`` (the single-object marker and fingerprint), the
    envelope's head fields in order, and the body's union ``branch`` (encoded). A value of
    another type is a TypeError, a long out of range an OverflowError, as fastavro's."""
    cause = b"\x00" if causation_id is None else b"\x02" + _text(causation_id)
    return b"".join(
        [
            header,
            _text(event_id),
            _text(session_id),
            _long_in_range(seq),
            _text(actor),
            _long_in_range(micros),
            cause,
            varint(len(prev_hash)),
            prev_hash,
            branch,
        ]
    )


def _string(value: Any) -> bytes:
    if type(value) is not str:
        raise Unusual
    data = value.encode()  # a lone surrogate raises: fastavro then raises its own error
    return varint(len(data)) + data


def _bytes(value: Any) -> bytes:
    if type(value) is not bytes:
        raise Unusual
    return varint(len(value)) + value


def _long(value: Any) -> bytes:
    if type(value) is not int or not MIN_LONG <= value <= MAX_LONG:
        raise Unusual
    return varint(value)


def _int(value: Any) -> bytes:
    if type(value) is not int or not _MIN_INT <= value <= _MAX_INT:
        raise Unusual
    return varint(value)


def _double(value: Any) -> bytes:
    if type(value) is not float:
        raise Unusual
    return _pack_double(value)


def _boolean(value: Any) -> bytes:
    if type(value) is not bool:
        raise Unusual
    return b"\x01" if value else b"\x00"


_PRIMITIVES: dict[str, _FieldWriter] = {
    "string": _string,
    "bytes": _bytes,
    "long": _long,
    "int": _int,
    "double": _double,
    "boolean": _boolean,
}


def _enum(symbols: list[str]) -> _FieldWriter:
    # A StrEnum member hashes and compares as its value, so it finds its symbol's index.
    index = {symbol: varint(i) for i, symbol in enumerate(symbols)}

    def write(value: Any) -> bytes:
        if not isinstance(value, str):
            raise Unusual
        encoded = index.get(value)
        if encoded is None:
            raise Unusual
        return encoded

    return write


def _optional(null_index: int, inner: _FieldWriter) -> _FieldWriter:
    null, other = varint(null_index), varint(1 - null_index)

    def write(value: Any) -> bytes:
        return null if value is None else other + inner(value)

    return write


def _array(item: _FieldWriter) -> _FieldWriter:
    # fastavro: one block of every item (count, items), then the empty block; [] is just that.
    def write(value: Any) -> bytes:
        if type(value) is not list:
            raise Unusual
        if not value:
            return b"\x00"
        return b"".join([varint(len(value)), *map(item, value), b"\x00"])

    return write


def _map(item: _FieldWriter) -> _FieldWriter:
    def write(value: Any) -> bytes:
        if type(value) is not dict:
            raise Unusual
        if not value:
            return b"\x00"
        parts = [varint(len(value))]
        for key, val in value.items():
            parts.append(_string(key))
            parts.append(item(val))
        parts.append(b"\x00")
        return b"".join(parts)

    return write


def _field_writer(schema: Any) -> _FieldWriter | None:
    """The writer of one field's Avro type, or None for a type this module leaves to fastavro."""
    if isinstance(schema, str):
        return _PRIMITIVES.get(schema)  # a named reference: None
    if isinstance(schema, list):
        if len(schema) != 2 or schema.count("null") != 1:
            return None
        null_index = schema.index("null")
        inner = _field_writer(schema[1 - null_index])
        return None if inner is None else _optional(null_index, inner)
    if isinstance(schema, dict):
        kind = schema.get("type")
        if "logicalType" in schema:
            return None
        if kind == "enum":
            return _enum(list(schema["symbols"]))
        if kind in ("array", "map"):
            inner = _field_writer(schema["items" if kind == "array" else "values"])
            if inner is None:
                return None
            return _array(inner) if kind == "array" else _map(inner)
        if isinstance(kind, str) and set(schema) == {"type"}:
            return _PRIMITIVES.get(kind)
    return None


def body_writer(schema: dict[str, Any]) -> BodyWriter | None:
    """The writer of a record schema (unparsed), or None if a field's type is not one of ours."""
    if schema.get("type") != "record":
        return None
    fields: list[tuple[str, _FieldWriter]] = []
    for field in schema["fields"]:
        writer = _field_writer(field["type"])
        if writer is None:
            return None
        fields.append((field["name"], writer))

    def write(values: dict[str, Any]) -> bytes:
        return b"".join([writer(values[name]) for name, writer in fields])

    return write
