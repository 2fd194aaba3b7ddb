"""Load the ``.avsc`` files, fingerprint them, and map records to models.

The envelope refers to every body type by name; ``fastavro.schema.load_schema``
resolves those names from the sibling files ``agentlog.<Name>.avsc``, so the
folder ``schemas/avro`` is all a reader in any language needs.

Every released version of the envelope is kept, fully expanded, in
``schemas/releases/agentlog.Envelope.v<N>.avsc``. Records carry the CRC-64-AVRO
fingerprint of the schema that wrote them; readers look the writer schema up by
that fingerprint and resolve it to the current one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from fastavro.schema import fingerprint, load_schema, parse_schema, to_parsing_canonical_form

from schemas import events
from schemas.envelope import Envelope

NAMESPACE = "agentlog"
AVRO_DIR = Path(__file__).parent / "avro"
RELEASES_DIR = Path(__file__).parent / "releases"
ENVELOPE_FILE = AVRO_DIR / f"{NAMESPACE}.Envelope.avsc"

_ALL_MODELS: tuple[type[events.Model], ...] = (*events.NESTED_TYPES, *events.EVENT_TYPES, Envelope)
MODEL_BY_NAME: dict[str, type[events.Model]] = {f"{NAMESPACE}.{m.__name__}": m for m in _ALL_MODELS}
"""Full Avro name -> pydantic model, for every record type."""


def full_name(model: type[events.Model]) -> str:
    """The Avro full name of a model's record, e.g. ``agentlog.ToolCallProposed``."""
    return f"{NAMESPACE}.{model.__name__}"


def avsc_path(name: str) -> Path:
    """The file that defines a named type (``agentlog.Vote`` -> ``.../agentlog.Vote.avsc``)."""
    return AVRO_DIR / f"{name}.avsc"


def read_avsc(name: str) -> dict[str, Any]:
    """The JSON of one ``.avsc`` file, as written (names unresolved)."""
    data: dict[str, Any] = json.loads(avsc_path(name).read_text())
    return data


def expanded_envelope() -> dict[str, Any]:
    """The current envelope schema with every named type inlined at first use.

    This is the self-contained form stored for each release.
    """
    seen: set[str] = set()

    def inline(node: Any) -> Any:
        if isinstance(node, str):
            if node.startswith(f"{NAMESPACE}.") and avsc_path(node).exists():
                if node in seen:
                    return node
                seen.add(node)
                return inline(read_avsc(node))
            return node
        if isinstance(node, list):
            return [inline(n) for n in node]
        if isinstance(node, dict):
            out = dict(node)
            if "fields" in out:
                out["fields"] = [{**f, "type": inline(f["type"])} for f in out["fields"]]
            elif out.get("type") == "array":
                out["items"] = inline(out["items"])
            elif out.get("type") == "map":
                out["values"] = inline(out["values"])
            return out
        return node

    seen.add(f"{NAMESPACE}.Envelope")
    result: dict[str, Any] = inline(read_avsc(f"{NAMESPACE}.Envelope"))
    return result


def canonical_fingerprint(schema: Any) -> bytes:
    """CRC-64-AVRO fingerprint (8 bytes, little-endian) of a schema's canonical form."""
    canonical = to_parsing_canonical_form(parse_schema(schema, _write_hint=False))
    # fastavro already spells the 64-bit value as its little-endian bytes.
    return bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))


@dataclass(frozen=True)
class Release:
    """One released version of the envelope schema."""

    version: int
    path: Path
    schema: dict[str, Any]
    fingerprint: bytes


@cache
def releases() -> tuple[Release, ...]:
    """Every released envelope version, oldest first."""
    found = []
    for path in RELEASES_DIR.glob(f"{NAMESPACE}.Envelope.v*.avsc"):
        version = int(path.name.removeprefix(f"{NAMESPACE}.Envelope.v").removesuffix(".avsc"))
        schema = json.loads(path.read_text())
        found.append(Release(version, path, schema, canonical_fingerprint(schema)))
    return tuple(sorted(found, key=lambda r: r.version))


@cache
def current_envelope_schema() -> Any:
    """The parsed current envelope schema, loaded from ``schemas/avro``."""
    return load_schema(str(ENVELOPE_FILE), _write_hint=False)


@cache
def current_fingerprint() -> bytes:
    """Fingerprint of the current envelope schema (what writers put in records)."""
    return canonical_fingerprint(expanded_envelope())


def schema_fingerprints() -> dict[str, bytes]:
    """CRC-64-AVRO fingerprint of every named type, by full name."""
    out: dict[str, bytes] = {}
    for path in sorted(AVRO_DIR.glob("*.avsc")):
        name = path.name.removesuffix(".avsc")
        out[name] = canonical_fingerprint(load_schema(str(path), _write_hint=False))
    return out


def write_release(version: int) -> Path:
    """Store the current envelope as release ``version`` (run when the contract changes)."""
    path = RELEASES_DIR / f"{NAMESPACE}.Envelope.v{version}.avsc"
    if path.exists():
        raise FileExistsError(f"{path} exists: released schemas are never rewritten; use a new version")
    path.write_text(json.dumps(expanded_envelope(), indent=2) + "\n")
    releases.cache_clear()
    return path


if __name__ == "__main__":  # python -m schemas.registry release N
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "release":
        print(write_release(int(sys.argv[2])))
    else:
        for name, fp in schema_fingerprints().items():
            print(f"{fp.hex()}  {name}")
