"""Avro single-object encoding of envelopes, and the hash that chains them.

Wire format of every record value (Avro specification, "Single object encoding")::

    C3 01 | 8-byte little-endian CRC-64-AVRO fingerprint of the writer schema | Avro binary body

The body is the envelope. Its last field is ``hash``, always 32 bytes, so the
body ends with ``0x40`` (the zig-zag varint length 32) and the 32 hash bytes.
Everything before those 33 bytes is the Avro encoding of the other fields, the
*canonical bytes*:

    hash = SHA-256(canonical bytes)

``prev_hash`` is one of the hashed fields, which chains each record to the
previous record of its (topic, session). Encoding therefore writes the envelope
without ``hash`` once, hashes it, and appends the hash: no second encode.

Fast path
---------
Every record is encoded, and every record written with the current schema is
decoded, by a fast path that produces and accepts exactly the bytes of the
generic one (fastavro writing or reading the whole envelope). Avro's binary
encoding of a record is the concatenation of its fields' encodings, in schema
order, with no framing; so the envelope is, field by field:

- ``event_id``, ``session_id``, ``actor`` (string): varint byte length, UTF-8 bytes;
- ``seq`` (long), ``occurred_at`` (long, timestamp-micros): one varint;
- ``causation_id`` (``["null", "string"]``): varint branch index 0, or 1 then a string;
- ``prev_hash``, ``hash`` (bytes): varint length, the bytes;
- ``body`` (union of every event type): varint branch index, then the record of that
  branch, in that branch's own schema (parsed once per type).

A varint here is Avro's: zig-zag, then little-endian base 128. The first seven
fields and the hash are coded by hand below. A body, whose shape varies, is
written by ``log.body_writer`` and read by ``log.body_reader``, each built once
per body type from its schema, or by fastavro where those leave it (bodies with
nested records, values or bytes they do not expect). Decoding reads the seven in
one pass (``log.head_reader.read_head``) when every length fits in one byte, as in
every record written here, and field by field (``_checked_head``, fastavro's errors
in fastavro's order) otherwise.
``Codec()`` checks that the envelope schema has exactly this layout and that
the body union lists ``schemas.events.EVENT_TYPES`` in order, and refuses to
start otherwise, so a schema change cannot silently diverge from the
hand-written part. ``tests/unit/log/test_codec_fast_path.py`` checks the
equivalence byte for byte against fastavro's generic writer and reader.

A body is handed to fastavro as its own ``__dict__`` when that equals its
``model_dump()`` (no nested models: scalars, enum members, lists and maps of
them), which saves the dump. A body read by ``log.body_reader`` whose every
field is typed exactly as it reads (the enum member, ``list[str]``, no
constraint) is built without validation, which would only copy it; every other
decoded body is validated by its pydantic model (that makes the enum members
and nested models). The envelope around them, whose fields the decoder has just
typed itself, is built without a second validation and without
``model_construct``'s per-field bookkeeping. Records of
older releases take the generic, schema-resolving path.
"""

from __future__ import annotations

import hashlib
import io
import typing
from datetime import datetime, timedelta
from typing import Any

from fastavro import schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError
from fastavro.schema import parse_schema
from pydantic import ValidationError

from log import native
from log.body_reader import BodyReader
from log.body_writer import BodyWriter, Unusual, varint
from log.errors import BadMagic, HashMismatch, SchemaMismatch, TruncatedRecord, UnknownFingerprint
from log.head_reader import EPOCH as _EPOCH
from log.head_reader import HASH_PREFIX, HASH_TAIL_LEN, HEAD_START, Head, build_envelope, read_long
from log.head_reader import construct as _build
from schemas import registry
from schemas.envelope import Envelope
from schemas.events import EVENT_TYPES, Model

MAGIC = b"\xc3\x01"
HEADER_LEN = len(MAGIC) + 8
HASH_LEN = 32
_HASH_PREFIX = b"\x40"  # zig-zag varint of the byte length 32
_HASH_TAIL_LEN = len(_HASH_PREFIX) + HASH_LEN
# log.head_reader keeps its own copies (it imports nothing of ours).
if (HEADER_LEN, _HASH_PREFIX[0], _HASH_TAIL_LEN) != (HEAD_START, HASH_PREFIX, HASH_TAIL_LEN):
    raise RuntimeError("log.head_reader's constants do not match the record layout")
ZERO_HASH = bytes(HASH_LEN)
"""prev_hash of the first record (seq 0) of every chain."""


_CAUSATION_BRANCHES = ("null", "string")
# The envelope fields the fast path codes by hand, with their exact Avro types, then body and hash.
_HEAD_FIELDS: tuple[tuple[str, Any], ...] = (
    ("event_id", "string"),
    ("session_id", "string"),
    ("seq", "long"),
    ("actor", "string"),
    ("occurred_at", {"type": "long", "logicalType": "timestamp-micros"}),
    ("causation_id", list(_CAUSATION_BRANCHES)),
    ("prev_hash", "bytes"),
)
_ENVELOPE_FIELDS = tuple(Envelope.model_fields)


def to_micros(moment: datetime) -> int:
    """Microseconds since the Unix epoch of an aware datetime."""
    delta = moment - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


# ------------------------------------------------------------ Avro primitives

# The readers below fail the way fastavro's reader does on the same bad bytes, so the
# generic path's exception mapping applies unchanged: no byte left where a long starts,
# or a string or bytes longer than what is left, is an EOFError (TruncatedRecord); the
# end of the data inside a long is an IndexError and bad UTF-8 a UnicodeDecodeError
# (both SchemaMismatch).


def _read_bytes(data: bytes, pos: int) -> tuple[bytes, int]:
    size, pos = read_long(data, pos)
    end = pos + size
    if size < 0 or end > len(data):
        raise EOFError(f"Expected {size} bytes, read {max(0, len(data) - pos)}")
    return data[pos:end], end


def _read_string(data: bytes, pos: int) -> tuple[str, int]:
    raw, pos = _read_bytes(data, pos)
    return raw.decode(), pos


def _checked_head(data: bytes) -> Head:
    """The head, read field by field as fastavro reads it (its errors, in its order)."""
    event_id, pos = _read_string(data, HEADER_LEN)
    session_id, pos = _read_string(data, pos)
    seq, pos = read_long(data, pos)
    actor, pos = _read_string(data, pos)
    micros, pos = read_long(data, pos)
    # As fastavro reads timestamp-micros, at the same point (out of range: OverflowError, as there).
    occurred_at = _EPOCH + timedelta(microseconds=micros)
    # Union branches are looked up by Python indexing, as fastavro's reader does: a
    # branch past the end is an IndexError, and a negative one (not valid Avro) counts
    # from the end there, so it does here too.
    branch, pos = read_long(data, pos)
    if _CAUSATION_BRANCHES[branch] == "string":
        causation_id: str | None
        causation_id, pos = _read_string(data, pos)
    else:
        causation_id = None
    prev_hash, pos = _read_bytes(data, pos)
    branch, pos = read_long(data, pos)
    return event_id, session_id, seq, actor, occurred_at, causation_id, prev_hash, branch, pos


# ------------------------------------------------------------ schemas and models


def _named_types(schema: Any, namespace: str, found: dict[str, Any]) -> None:
    """Collect every named type (record, enum, fixed) defined in ``schema``, by full name."""
    if isinstance(schema, list):
        for branch in schema:
            _named_types(branch, namespace, found)
    elif isinstance(schema, dict):
        if schema.get("type") in ("record", "enum", "fixed"):
            namespace = schema.get("namespace", namespace)
            name = schema["name"] if "." in schema["name"] else f"{namespace}.{schema['name']}"
            found[name] = schema
        for field in schema.get("fields", ()):
            _named_types(field["type"], namespace, found)
        for key in ("items", "values"):
            if key in schema:
                _named_types(schema[key], namespace, found)


def _standalone(schema: Any, names: dict[str, Any], defined: set[str]) -> Any:
    """``schema`` with each named type it refers to defined at its first use, so it parses alone.

    In the expanded envelope a named type is defined where it is first used and
    referred to by name after that, possibly from another body type.
    """
    if isinstance(schema, str):
        if schema in names and schema not in defined:
            return _standalone(names[schema], names, defined)
        return schema
    if isinstance(schema, list):
        return [_standalone(branch, names, defined) for branch in schema]
    if isinstance(schema, dict):
        out = dict(schema)
        if schema.get("type") in ("record", "enum", "fixed"):
            namespace = schema.get("namespace", registry.NAMESPACE)
            defined.add(schema["name"] if "." in schema["name"] else f"{namespace}.{schema['name']}")
        if "fields" in out:
            out["fields"] = [{**f, "type": _standalone(f["type"], names, defined)} for f in out["fields"]]
        for key in ("items", "values"):
            if key in out:
                out[key] = _standalone(out[key], names, defined)
        return out
    return schema


_M = typing.TypeVar("_M", bound=Model)


def _construct(model: type[_M], values: dict[str, Any]) -> _M:
    """What ``model.model_construct(**values)`` returns when ``values`` holds every field in order.

    ``model_construct`` looks up aliases and defaults field by field (about 4 us for an
    envelope, more than validating it); with every field present there is nothing to
    look up. Only for models that ``_plain`` accepts (no post-init, no private
    attributes, no extras, no aliases, no validators).

    Every instance of a model shares one set of its field names as its fields set: our
    models are frozen, so pydantic never adds to it (and the names are all in it already),
    and ``model_copy`` copies it before changing it. Two fewer objects to make and free per
    record. (``log.head_reader.construct`` builds it; the decode of nearly every record does
    so inside ``read_envelope``.)
    """
    built: _M = _build(model, values, _fields_set(model))
    return built


def _fields_set(model: type[Model]) -> set[str]:
    """The one set of ``model``'s field names its constructed instances share (``_construct``)."""
    fields_set = _FIELDS_SET.get(model)
    if fields_set is None:
        fields_set = _FIELDS_SET[model] = set(model.model_fields)
    return fields_set


_FIELDS_SET: dict[type[Model], set[str]] = {}
"""Each constructed model's field names (``_construct``)."""


def _plain(model: type[Model]) -> bool:
    """Whether ``_construct`` builds ``model`` as ``model_construct`` would (nothing it skips applies),
    and may share its fields set (the model is frozen)."""
    decorators = model.__pydantic_decorators__
    return (
        model.model_config.get("frozen") is True  # instances share their fields set
        and model.__pydantic_post_init__ is None
        and not model.__pydantic_root_model__
        and not model.__private_attributes__
        and model.model_config.get("extra") != "allow"
        and not any(
            (
                decorators.validators,
                decorators.field_validators,
                decorators.root_validators,
                decorators.model_validators,
            )
        )
        and all(f.alias is None and f.validation_alias is None for f in model.model_fields.values())
    )


def _is_flat(model: type[Model]) -> bool:
    """Whether ``body.__dict__`` is ``body.model_dump()``: no nested models, whose dump is a dict."""
    decorators = model.__pydantic_decorators__
    if decorators.field_serializers or decorators.model_serializers or decorators.computed_fields:
        return False  # model_dump() would run code of the model's own
    if any(f.exclude or f.serialization_alias is not None for f in model.model_fields.values()):
        return False
    hints = typing.get_type_hints(model)

    def flat(annotation: Any) -> bool:
        if isinstance(annotation, type) and issubclass(annotation, Model):
            return False
        return all(flat(arg) for arg in typing.get_args(annotation))

    # Scalars, enums (dumped as the member itself) and lists, dicts, Optionals of them.
    return all(flat(hints[name]) for name in model.model_fields)


class _BodyType:
    """The fast path's view of one branch of the envelope's body union."""

    __slots__ = ("construct", "flat", "index", "model", "name", "read", "schema", "write")

    def __init__(self, index: int, model: type[Model], schema: dict[str, Any], readers: Any, writers: Any) -> None:
        self.index = varint(index)  # the branch's union index, encoded
        self.model = model
        self.name = registry.full_name(model)
        self.schema = parse_schema(schema, named_schemas={})
        self.flat = _is_flat(model)
        # A writer and a reader of our own for the bodies whose __dict__ is their dump
        # (log.body_writer, log.body_reader).
        self.write: BodyWriter | None = writers.body_writer(schema) if self.flat else None
        hints = typing.get_type_hints(model)
        self.read: BodyReader | None = readers.body_reader(schema, hints) if self.flat else None
        # Whether what that reader reads is the body as is: validating would only copy it.
        constrained = {name for name, f in model.model_fields.items() if f.metadata or f.discriminator}
        self.construct = (
            self.read is not None
            and _plain(model)
            and [f["name"] for f in schema["fields"]] == list(model.model_fields)
            and readers.constructible(schema, hints, constrained)
        )


def _check_layout(expanded: dict[str, Any]) -> None:
    """Refuse an envelope schema the fast path does not code exactly (see the module docstring)."""
    fields = [(f["name"], f["type"]) for f in expanded["fields"]]
    body = [registry.full_name(m) for m in EVENT_TYPES]
    branches = [
        b if isinstance(b, str) else f"{b.get('namespace', registry.NAMESPACE)}.{b['name']}" for b in fields[7][1]
    ]
    if (
        fields[:7] != list(_HEAD_FIELDS)
        or fields[7][0] != "body"
        or branches != body
        or fields[8:] != [("hash", "bytes")]
    ):
        raise RuntimeError(
            "the envelope schema no longer has the layout log/codec.py codes by hand "
            f"({', '.join(name for name, _ in fields)}); update its fast path"
        )
    if tuple(name for name, _ in fields) != _ENVELOPE_FIELDS or not _plain(Envelope):
        raise RuntimeError("the Envelope model and the envelope schema disagree (see log/codec.py)")


class Codec:
    """Encodes envelopes with the current schema; decodes any released one.

    One instance parses the schemas once; it holds no per-record state and is
    safe to share.
    """

    def __init__(self, *, compiled: bool | None = None) -> None:
        """``compiled``: read with the mypyc builds of the readers where they are current
        (``log.native``; default unless ``AGENTLOG_NATIVE=0``); the results are the same."""
        expanded = registry.expanded_envelope()
        if expanded["fields"][-1]["name"] != "hash":
            raise RuntimeError("the envelope's last field must be hash (see log/codec.py)")
        _check_layout(expanded)
        self._reader = parse_schema(expanded)
        self.fingerprint = registry.current_fingerprint()
        self._header = MAGIC + self.fingerprint
        # Writer schemas by fingerprint: every release (old records) and the current one.
        self._writers: dict[bytes, Any] = {}
        for release in registry.releases():
            self._writers[release.fingerprint] = parse_schema(release.schema, named_schemas={})
        self._writers[self.fingerprint] = self._reader
        readers = native.module("body_reader", compiled=compiled)
        head_reader = native.module("head_reader", compiled=compiled)
        self._read_head = head_reader.read_head
        self._read_envelope = head_reader.read_envelope
        writers = native.module("body_writer", compiled=compiled)
        self._write_head = writers.write_head
        self._unusual_value = (writers.Unusual, KeyError, UnicodeEncodeError)  # the writer's own Unusual
        self.compiled = readers.__name__.startswith("log._native.")
        """Whether the body readers are the mypyc build (``log.native``)."""
        # The fast path: one schema per body type, from the current envelope, parsed on its own.
        names: dict[str, Any] = {}
        _named_types(expanded, registry.NAMESPACE, names)
        self._bodies = [
            _BodyType(i, model, _standalone(names[registry.full_name(model)], names, set()), readers, writers)
            for i, model in enumerate(EVENT_TYPES)
        ]
        self._body_of: dict[type[Model], _BodyType] = {b.model: b for b in self._bodies}
        # What read_record reads a body with: the bodies it may build as read, and no others.
        self._as_read = [b.read if b.construct else None for b in self._bodies]
        self._built = [(b.model, _fields_set(b.model)) for b in self._bodies]
        self._envelope_built = (Envelope, _fields_set(Envelope))

    # ------------------------------------------------------------------ encode

    def encode(
        self,
        *,
        event_id: str,
        session_id: str,
        seq: int,
        actor: str,
        occurred_at: datetime,
        causation_id: str | None,
        prev_hash: bytes,
        body: Model,
    ) -> tuple[bytes, bytes]:
        """Encode one record; returns ``(record bytes, hash)``."""
        body_type = self._body_of.get(type(body))
        if body_type is None:
            raise ValueError(f"a {type(body).__name__} is not an event body (see schemas.events.EVENT_TYPES)")
        if causation_id is not None and not isinstance(causation_id, str):
            raise ValueError(f"causation_id {causation_id!r} is neither null nor a string")
        head = self._write_head(
            self._header,
            event_id,
            session_id,
            seq,
            actor,
            to_micros(occurred_at),
            causation_id,
            prev_hash,
            body_type.index,
        )
        encoded = None
        if body_type.write is not None:
            try:
                encoded = body_type.write(body.__dict__)
            except self._unusual_value:
                encoded = None  # fastavro decides what such a value means (or which error it is)
        if encoded is None:
            buf = io.BytesIO()
            # fastavro only reads the dict; a flat body's own __dict__ equals its model_dump().
            schemaless_writer(buf, body_type.schema, body.__dict__ if body_type.flat else body.model_dump())
            encoded = buf.getvalue()
        hashed = hashlib.sha256(memoryview(head)[HEADER_LEN:])
        hashed.update(encoded)
        digest = hashed.digest()
        return b"".join((head, encoded, _HASH_PREFIX, digest)), digest

    # ------------------------------------------------------------------ decode

    def decode(self, data: bytes) -> Envelope:
        """Decode and self-verify one record, or raise a DecodeError / HashMismatch."""
        if (
            type(data) is bytes
            and (envelope := self._read_envelope(data, self._header, self._as_read, self._built, self._envelope_built))
            is not None
        ):
            # Nearly every record: one call reads, checks and builds it all (log.head_reader);
            # what that leaves, from a forged length to an old release, is read step by step below.
            return envelope  # type: ignore[no-any-return]
        if len(data) < HEADER_LEN:
            if data[: len(MAGIC)] != MAGIC[: len(data)]:
                raise BadMagic(f"record starts with {data[:2].hex() or 'nothing'}, not c301 (Avro single-object)")
            raise TruncatedRecord(f"record is {len(data)} bytes, shorter than the {HEADER_LEN}-byte header")
        if data[:2] != MAGIC:
            raise BadMagic(f"record starts with {data[:2].hex()}, not c301 (Avro single-object encoding)")
        fingerprint = bytes(data[2:HEADER_LEN])
        if fingerprint == self.fingerprint:
            return self._decode_current(data if type(data) is bytes else bytes(data))
        writer = self._writers.get(fingerprint)
        if writer is None:
            raise UnknownFingerprint(
                f"writer schema fingerprint {fingerprint.hex()} is not a released envelope schema "
                f"(known: {', '.join(fp.hex() for fp in self._writers)}); was it written by a newer agentlog?"
            )
        payload = memoryview(data)[HEADER_LEN:]
        buf = io.BytesIO(payload)
        reader = None if writer is self._reader else self._reader
        try:
            raw = schemaless_reader(buf, writer, reader, return_record_name=True, return_record_name_override=True)
        except (EOFError, StopIteration) as e:
            raise TruncatedRecord(f"record body ends early ({len(payload)} bytes): {e or type(e).__name__}") from e
        except SchemaResolutionError as e:
            raise SchemaMismatch(f"writer schema {fingerprint.hex()} does not resolve to the reader schema: {e}") from e
        except (ValueError, IndexError, UnicodeDecodeError, TypeError, KeyError, OverflowError) as e:
            # OverflowError: a timestamp outside what a datetime holds (a forged or corrupt record).
            raise SchemaMismatch(f"record body does not decode with schema {fingerprint.hex()}: {e}") from e
        if not isinstance(raw, dict):
            raise SchemaMismatch(f"record body decoded to {type(raw).__name__}, not a record")
        if buf.tell() != len(payload):
            raise SchemaMismatch(f"{len(payload) - buf.tell()} bytes follow the end of the record body")
        stored_hash = raw["hash"]
        if len(stored_hash) != HASH_LEN or payload[-_HASH_TAIL_LEN] != _HASH_PREFIX[0]:
            raise SchemaMismatch(f"hash field is {len(stored_hash)} bytes, not {HASH_LEN}")
        actual = hashlib.sha256(payload[:-_HASH_TAIL_LEN]).digest()
        if actual != stored_hash:
            raise HashMismatch(
                f"record {raw['event_id']} of session {raw['session_id']} does not match its own hash "
                f"(stored {stored_hash.hex()[:12]}..., computed {actual.hex()[:12]}...): it was altered after writing"
            )
        return self._envelope(raw)

    def _decode_current(self, data: bytes) -> Envelope:
        """``decode`` of a record written with the current schema: the fast path (module docstring).

        Checks and errors are the generic path's, in the same order.
        """
        size = len(data) - HEADER_LEN
        try:
            head = self._read_head(data)
            if head is None:
                head = _checked_head(data)
            event_id, session_id, seq, actor, occurred_at, causation_id, prev_hash, branch, pos = head
            body_type = self._bodies[branch]
            values: Any = None
            if body_type.read is not None:
                try:
                    values, pos = body_type.read(data, pos)
                except Unusual:
                    values = None  # fastavro decides what such bytes mean (or which error they are)
            read_as_is = values is not None and body_type.construct
            if values is None:
                buf = io.BytesIO(data)
                buf.seek(pos)
                values = schemaless_reader(
                    buf, body_type.schema, None, return_record_name=True, return_record_name_override=True
                )
                pos = buf.tell()
            if pos + _HASH_TAIL_LEN == len(data) and data[pos] == _HASH_PREFIX[0]:
                stored_hash, pos = data[pos + 1 :], len(data)  # what _read_bytes reads there
            else:
                stored_hash, pos = _read_bytes(data, pos)
        except (EOFError, StopIteration) as e:
            raise TruncatedRecord(f"record body ends early ({size} bytes): {e or type(e).__name__}") from e
        except (ValueError, IndexError, UnicodeDecodeError, TypeError, KeyError, OverflowError) as e:
            raise SchemaMismatch(f"record body does not decode with schema {self.fingerprint.hex()}: {e}") from e
        if not isinstance(values, dict):
            raise SchemaMismatch(f"{body_type.name} body decoded to {type(values).__name__}, not a record")
        if pos != len(data):
            raise SchemaMismatch(f"{len(data) - pos} bytes follow the end of the record body")
        if len(stored_hash) != HASH_LEN or data[-_HASH_TAIL_LEN] != _HASH_PREFIX[0]:
            raise SchemaMismatch(f"hash field is {len(stored_hash)} bytes, not {HASH_LEN}")
        actual = hashlib.sha256(memoryview(data)[HEADER_LEN:-_HASH_TAIL_LEN]).digest()
        if actual != stored_hash:
            raise HashMismatch(
                f"record {event_id} of session {session_id} does not match its own hash "
                f"(stored {stored_hash.hex()[:12]}..., computed {actual.hex()[:12]}...): it was altered after writing"
            )
        if read_as_is:
            # Every field already holds what validation would make of it (log.body_reader).
            body = _construct(body_type.model, values)
        else:
            try:
                # Validated, as in the generic path: it makes the enum members and nested models.
                body = body_type.model.model_validate(values)
            except ValidationError as e:
                raise SchemaMismatch(f"{body_type.name} body does not match its model: {e}") from e
        envelope: Envelope = build_envelope(
            self._envelope_built,
            event_id,
            session_id,
            seq,
            actor,
            occurred_at,
            causation_id,
            prev_hash,
            body,
            stored_hash,
        )
        return envelope

    @staticmethod
    def _envelope(raw: dict[str, Any]) -> Envelope:
        name, body = raw["body"]
        model = registry.MODEL_BY_NAME.get(name)
        if model is None:
            raise SchemaMismatch(f"body type {name} has no model in this version of agentlog")
        try:
            raw["body"] = model.model_validate(body)
        except ValidationError as e:
            raise SchemaMismatch(f"{name} body does not match its model: {e}") from e
        # The Avro decode already checked every field's type; skip a second validation.
        return Envelope.model_construct(**raw)
