"""Avro binary readers for flat event bodies, built once per body type from its schema.

The reading side of ``log.body_writer``. ``fastavro.schemaless_reader`` costs about
3.5 us per body before the first field (a ``BytesIO``, its options, the parsed schema's
checks) and half a microsecond per item of an array of strings, which made it the
largest part of decoding a record: 30 of the 40 us of a ``KVBlocksStored`` with 54
block hashes. A reader made of one small function per field does the same in a
fraction of that.

Exactly fastavro's values, or nothing: a reader reads well-formed data of the types
``body_writer`` writes (string, bytes, long, int, double, boolean, an enum, a
``["null", T]`` union, arrays and maps of those). On anything else (bad UTF-8, a
length past the end, a union branch or enum index out of range, an array block
with its byte size, a boolean byte other than 0 or 1) it raises ``Unusual`` and
``log.codec`` reads that body with fastavro instead, which then decides what the
bytes mean or which error they are. A schema with any other type gets no reader.

Enums are read as the members of the model's enum, so a body whose every field is
typed exactly as read needs no validation to be built (``constructible``).
``tests/unit/log/test_codec_fast_path.py`` checks every event type, generated
bodies and forged bytes against fastavro's generic reader and the model's validation.
"""

from __future__ import annotations

import enum
import struct
import types
import typing
from collections.abc import Callable
from typing import Any

from log.body_writer import Unusual

__all__ = ["BodyReader", "body_reader", "constructible"]

BodyReader = Callable[[bytes, int], tuple[dict[str, Any], int]]
"""Record bytes and the position of a body to the body's field values and the position after it."""

_FieldReader = Callable[[bytes, int], tuple[Any, int]]

_unpack_double = struct.Struct("<d").unpack_from


def _long(data: bytes, pos: int) -> tuple[int, int]:
    """Avro's zig-zag varint at ``pos``; ``Unusual`` where fastavro would read it otherwise.

    ``log.head_reader.read_long`` reads the same varint; this module keeps its own because a
    call into another compiled module is a Python call (reading a body with that one was
    1.3-1.6x slower), and it hands the rare ten-byte long to fastavro instead."""
    b = data[pos]  # past the end: IndexError, which the reader turns into Unusual
    if b < 0x80:
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
        if shift >= 63:
            raise Unusual  # ten bytes or more: left to fastavro, whose reader decides
    return (n >> 1) ^ -(n & 1), pos + 1


def _bytes(data: bytes, pos: int) -> tuple[bytes, int]:
    size, pos = _long(data, pos)
    end = pos + size
    if size < 0 or end > len(data):
        raise Unusual
    return data[pos:end], end


def _string(data: bytes, pos: int) -> tuple[str, int]:
    n = data[pos]
    if not n & 0x81:  # a one-byte, non-negative length: nearly every string
        end = pos + 1 + (n >> 1)
        if end > len(data):
            raise Unusual
        return data[pos + 1 : end].decode(), end  # bad UTF-8: UnicodeDecodeError, then Unusual
    raw, pos = _bytes(data, pos)
    return raw.decode(), pos


def _double(data: bytes, pos: int) -> tuple[float, int]:
    if pos + 8 > len(data):
        raise Unusual
    return _unpack_double(data, pos)[0], pos + 8


def _boolean(data: bytes, pos: int) -> tuple[bool, int]:
    b = data[pos]
    if b > 1:
        raise Unusual
    return b == 1, pos + 1


_PRIMITIVES: dict[str, _FieldReader] = {
    "string": _string,
    "bytes": _bytes,
    "long": _long,
    "int": _long,  # the same varint; fastavro reads an int as a long too
    "double": _double,
    "boolean": _boolean,
}


def _enum(members: list[Any]) -> _FieldReader:
    def read(data: bytes, pos: int) -> tuple[Any, int]:
        index, pos = _long(data, pos)
        if not 0 <= index < len(members):
            raise Unusual
        return members[index], pos

    return read


def _optional(null_index: int, inner: _FieldReader) -> _FieldReader:
    def read(data: bytes, pos: int) -> tuple[Any, int]:
        branch = data[pos]
        if branch == null_index << 1:
            return None, pos + 1
        if branch == (1 - null_index) << 1:
            return inner(data, pos + 1)
        raise Unusual

    return read


def _array(item: _FieldReader) -> _FieldReader:
    def read(data: bytes, pos: int) -> tuple[list[Any], int]:
        out: list[Any] = []
        append = out.append
        count, pos = _long(data, pos)
        while count:
            if count < 0:
                raise Unusual  # a block with its byte size: fastavro reads it
            for _ in range(count):
                value, pos = item(data, pos)
                append(value)
            count, pos = _long(data, pos)
        return out, pos

    if item is _string:  # block hashes, call ids: the common array, read without a call per item

        def read_strings(data: bytes, pos: int) -> tuple[list[Any], int]:
            out: list[Any] = []
            append = out.append
            count, pos = _long(data, pos)
            size = len(data)
            while count:
                if count < 0:
                    raise Unusual
                for _ in range(count):
                    n = data[pos]
                    if n & 0x81:
                        value, pos = _string(data, pos)
                        append(value)
                        continue
                    end = pos + 1 + (n >> 1)
                    if end > size:
                        raise Unusual
                    append(data[pos + 1 : end].decode())
                    pos = end
                count, pos = _long(data, pos)
            return out, pos

        return read_strings
    return read


def _map(item: _FieldReader) -> _FieldReader:
    def read(data: bytes, pos: int) -> tuple[dict[str, Any], int]:
        out: dict[str, Any] = {}
        count, pos = _long(data, pos)
        while count:
            if count < 0:
                raise Unusual
            for _ in range(count):
                key, pos = _string(data, pos)
                out[key], pos = item(data, pos)
            count, pos = _long(data, pos)
        return out, pos

    return read


def _enum_class(annotation: Any) -> type[enum.Enum] | None:
    """The enum a field is typed with, through ``T | None``, lists and dicts; None if there is none."""
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation
    for arg in typing.get_args(annotation):
        found = _enum_class(arg)
        if found is not None:
            return found
    return None


def _field_reader(schema: Any, annotation: Any) -> _FieldReader | None:
    """The reader of one field's Avro type, or None for a type this module leaves to fastavro."""
    if isinstance(schema, str):
        return _PRIMITIVES.get(schema)  # a named reference: None
    if isinstance(schema, list):
        if len(schema) != 2 or schema.count("null") != 1:
            return None
        null_index = schema.index("null")
        inner = _field_reader(schema[1 - null_index], annotation)
        return None if inner is None else _optional(null_index, inner)
    if isinstance(schema, dict):
        kind = schema.get("type")
        if "logicalType" in schema:
            return None
        if kind == "enum":
            model_enum = _enum_class(annotation)
            symbols = list(schema["symbols"])
            if model_enum is None or sorted(m.value for m in model_enum) != sorted(symbols):
                return None  # the model's enum is not the schema's: validation decides
            return _enum([model_enum(symbol) for symbol in symbols])
        if kind in ("array", "map"):
            inner = _field_reader(schema["items" if kind == "array" else "values"], annotation)
            if inner is None:
                return None
            return _array(inner) if kind == "array" else _map(inner)
        if isinstance(kind, str) and set(schema) == {"type"}:
            return _PRIMITIVES.get(kind)
    return None


def _enums_inlined(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's fields, with each reference to an enum defined in an earlier field replaced
    by that definition (``KVSwapCompleted``'s ``to_tier`` names the ``KVTier`` of ``from_tier``)."""
    defined: dict[str, Any] = {}

    def inline(node: Any) -> Any:
        if isinstance(node, str):
            return defined.get(node, node)
        if isinstance(node, list):
            return [inline(branch) for branch in node]
        if isinstance(node, dict):
            if node.get("type") == "enum":
                name = node["name"]
                defined[name if "." in name else f"{node.get('namespace', '')}.{name}".lstrip(".")] = node
                return node
            return {k: inline(v) if k in ("items", "values") else v for k, v in node.items()}
        return node

    return [{**field, "type": inline(field["type"])} for field in schema["fields"]]


def body_reader(schema: dict[str, Any], hints: dict[str, Any]) -> BodyReader | None:
    """The reader of a record schema (unparsed), or None if a field's type is not one of ours.

    ``hints`` are the model's field annotations, which name the enum each enum field holds.
    """
    if schema.get("type") != "record":
        return None
    fields: list[tuple[str, int, int, _FieldReader]] = []
    for field in _enums_inlined(schema):
        reader = _field_reader(field["type"], hints.get(field["name"]))
        if reader is None:
            return None
        fields.append((field["name"], *_kind(field["type"]), reader))

    def read(data: bytes, pos: int) -> tuple[dict[str, Any], int]:
        values: dict[str, Any] = {}
        try:
            for name, kind, null_index, reader in fields:
                if null_index >= 0:  # ["null", T] or [T, "null"] of a primitive T
                    branch = data[pos]
                    if branch == null_index << 1:
                        values[name] = None
                        pos += 1
                        continue
                    if branch != (1 - null_index) << 1:
                        raise Unusual
                    pos += 1
                # A primitive by a direct call: compiled, a call in C whose pair is not boxed.
                if kind == _STRING:
                    values[name], pos = _string(data, pos)
                elif kind == _LONG:
                    values[name], pos = _long(data, pos)
                elif kind == _DOUBLE:
                    values[name], pos = _double(data, pos)
                elif kind == _BOOLEAN:
                    values[name], pos = _boolean(data, pos)
                elif kind == _BYTES:
                    values[name], pos = _bytes(data, pos)
                else:
                    values[name], pos = reader(data, pos)
        except (IndexError, UnicodeDecodeError):
            raise Unusual from None
        return values, pos

    return read


# The kinds of field a body's reader reads itself (``_kind``); every other field through its reader.
_OTHER, _STRING, _LONG, _DOUBLE, _BOOLEAN, _BYTES = range(6)
_KINDS = {"string": _STRING, "bytes": _BYTES, "long": _LONG, "int": _LONG, "double": _DOUBLE, "boolean": _BOOLEAN}


def _kind(schema: Any) -> tuple[int, int]:
    """A field's kind, and the union index of null if it is ``["null", T]`` or ``[T, "null"]``
    of a primitive T (else -1). Most fields are one of those: each of them read by its own
    reader was a call through a Python object, and a pair built and unpacked."""
    if isinstance(schema, str):
        return _KINDS.get(schema, _OTHER), -1
    if isinstance(schema, list) and len(schema) == 2 and schema.count("null") == 1:
        null_index = schema.index("null")
        other = schema[1 - null_index]
        if isinstance(other, str) and other in _KINDS:
            return _KINDS[other], null_index
    return _OTHER, -1


# What each primitive Avro type reads as; a field typed with exactly that needs no validation.
_READS_AS: dict[str, type] = {
    "string": str,
    "bytes": bytes,
    "long": int,
    "int": int,
    "double": float,
    "boolean": bool,
}


def _typed_as_read(schema: Any, annotation: Any) -> bool:
    """Whether pydantic would keep a value read with ``schema`` as it is in a field of ``annotation``."""
    while isinstance(annotation, typing.NewType):
        annotation = annotation.__supertype__
    if isinstance(schema, str):
        return _READS_AS.get(schema) is annotation
    if isinstance(schema, list):
        args = typing.get_args(annotation)
        if typing.get_origin(annotation) not in (typing.Union, types.UnionType) or len(args) != 2:
            return False
        if type(None) not in args or len(schema) != 2 or "null" not in schema:
            return False
        inner = next(a for a in args if a is not type(None))
        return _typed_as_read(schema[1 - schema.index("null")], inner)
    if isinstance(schema, dict):
        kind = schema.get("type")
        if kind == "enum":
            return isinstance(annotation, type) and issubclass(annotation, enum.Enum)
        if kind == "array":
            args = typing.get_args(annotation)
            return typing.get_origin(annotation) is list and len(args) == 1 and _typed_as_read(schema["items"], args[0])
        if kind == "map":
            args = typing.get_args(annotation)
            return (
                typing.get_origin(annotation) is dict
                and len(args) == 2
                and args[0] is str
                and _typed_as_read(schema["values"], args[1])
            )
        if isinstance(kind, str) and set(schema) == {"type"}:
            return _typed_as_read(kind, annotation)
    return False


def constructible(schema: dict[str, Any], hints: dict[str, Any], constrained: set[str]) -> bool:
    """Whether a body read by ``body_reader`` is what the model's validation would make of it.

    True when every field is typed exactly as it reads (``str`` for a string, the enum for
    an enum, ``list[str]`` for an array of strings, ...) and carries no constraint
    (``constrained``: the fields with validation metadata), so validating would only copy.
    """
    return all(
        field["name"] not in constrained and _typed_as_read(field["type"], hints.get(field["name"]))
        for field in _enums_inlined(schema)
    )
