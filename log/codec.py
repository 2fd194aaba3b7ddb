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
"""

from __future__ import annotations

import hashlib
import io
from datetime import UTC, datetime
from typing import Any

from fastavro import schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError
from fastavro.schema import parse_schema
from pydantic import ValidationError

from log.errors import BadMagic, HashMismatch, SchemaMismatch, TruncatedRecord, UnknownFingerprint
from schemas import registry
from schemas.envelope import Envelope
from schemas.events import Model

MAGIC = b"\xc3\x01"
HEADER_LEN = len(MAGIC) + 8
HASH_LEN = 32
_HASH_PREFIX = b"\x40"  # zig-zag varint of the byte length 32
_HASH_TAIL_LEN = len(_HASH_PREFIX) + HASH_LEN
ZERO_HASH = bytes(HASH_LEN)
"""prev_hash of the first record (seq 0) of every chain."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def to_micros(moment: datetime) -> int:
    """Microseconds since the Unix epoch of an aware datetime."""
    delta = moment - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


class Codec:
    """Encodes envelopes with the current schema; decodes any released one.

    One instance parses the schemas once; it holds no per-record state and is
    safe to share.
    """

    def __init__(self) -> None:
        expanded = registry.expanded_envelope()
        if expanded["fields"][-1]["name"] != "hash":
            raise RuntimeError("the envelope's last field must be hash (see log/codec.py)")
        self._reader = parse_schema(expanded)
        unhashed = {**expanded, "fields": expanded["fields"][:-1]}
        self._unhashed_writer = parse_schema(unhashed, named_schemas={})
        self.fingerprint = registry.current_fingerprint()
        self._header = MAGIC + self.fingerprint
        # Writer schemas by fingerprint: every release (old records) and the current one.
        self._writers: dict[bytes, Any] = {}
        for release in registry.releases():
            self._writers[release.fingerprint] = parse_schema(release.schema, named_schemas={})
        self._writers[self.fingerprint] = self._reader

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
        fields = {
            "event_id": event_id,
            "session_id": session_id,
            "seq": seq,
            "actor": actor,
            "occurred_at": to_micros(occurred_at),
            "causation_id": causation_id,
            "prev_hash": prev_hash,
            # Tuple notation names the union branch, so fastavro need not guess it.
            "body": (f"{registry.NAMESPACE}.{type(body).__name__}", body.model_dump()),
        }
        buf = io.BytesIO()
        buf.write(self._header)
        schemaless_writer(buf, self._unhashed_writer, fields)
        digest = hashlib.sha256(buf.getbuffer()[HEADER_LEN:]).digest()
        buf.write(_HASH_PREFIX)
        buf.write(digest)
        return buf.getvalue(), digest

    # ------------------------------------------------------------------ decode

    def decode(self, data: bytes) -> Envelope:
        """Decode and self-verify one record, or raise a DecodeError / HashMismatch."""
        if len(data) < HEADER_LEN:
            if data[: len(MAGIC)] != MAGIC[: len(data)]:
                raise BadMagic(f"record starts with {data[:2].hex() or 'nothing'}, not c301 (Avro single-object)")
            raise TruncatedRecord(f"record is {len(data)} bytes, shorter than the {HEADER_LEN}-byte header")
        if data[:2] != MAGIC:
            raise BadMagic(f"record starts with {data[:2].hex()}, not c301 (Avro single-object encoding)")
        fingerprint = bytes(data[2:HEADER_LEN])
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
        except (ValueError, IndexError, UnicodeDecodeError, TypeError, KeyError) as e:
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
