"""The pydantic models and the .avsc files describe the same records, field for field."""

from __future__ import annotations

import datetime as dt
import enum
import json
import types
import typing
from typing import Any

import pytest
from pydantic import Field, create_model

from schemas import events, registry
from schemas.envelope import Envelope
from schemas.events import Model

pytestmark = pytest.mark.unit

RECORD_MODELS = sorted(registry.MODEL_BY_NAME.items())


def expected_avro_type(annotation: Any, field_name: str = "") -> Any:
    """The Avro type a model field annotation must have in the .avsc file."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if field_name == "body":
            return [registry.full_name(m) for m in args]
        others = [a for a in args if a is not type(None)]
        assert len(others) == 1 and len(args) == 2, f"only Optional[X] unions are mapped, got {annotation}"
        return ["null", expected_avro_type(others[0])]
    if origin is list:
        return {"type": "array", "items": expected_avro_type(typing.get_args(annotation)[0])}
    if origin is dict:
        key, value = typing.get_args(annotation)
        assert key is str, "Avro maps have string keys"
        return {"type": "map", "values": expected_avro_type(value)}
    scalar = {str: "string", int: "long", float: "double", bool: "boolean", bytes: "bytes"}
    if annotation in scalar:
        return scalar[annotation]
    if annotation is dt.datetime:
        return {"type": "long", "logicalType": "timestamp-micros"}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum | Model):
        return f"{registry.NAMESPACE}.{annotation.__name__}"
    raise AssertionError(f"no Avro mapping for {annotation!r}")


def differences(model: type[Model], avsc: dict[str, Any]) -> list[str]:
    """Every way the model and its .avsc disagree (empty when they match)."""
    problems = []
    hints = typing.get_type_hints(model)
    model_fields = list(model.model_fields)
    avsc_fields = [f["name"] for f in avsc["fields"]]
    if model_fields != avsc_fields:
        only_model = sorted(set(model_fields) - set(avsc_fields))
        only_avsc = sorted(set(avsc_fields) - set(model_fields))
        problems.append(f"fields differ: only in model {only_model}, only in avsc {only_avsc}, or order differs")
    if not avsc.get("doc"):
        problems.append("record has no doc")
    for field in avsc["fields"]:
        name = field["name"]
        if name not in model.model_fields:
            continue
        info = model.model_fields[name]
        if field["type"] != expected_avro_type(hints[name], name):
            problems.append(f"{name}: avsc type {field['type']} != model type {hints[name]}")
        if not field.get("doc"):
            problems.append(f"{name}: no doc")
        elif field["doc"] != info.description:
            problems.append(f"{name}: doc differs from the model's description")
        if info.is_required() == ("default" in field):
            problems.append(f"{name}: required in one and defaulted in the other")
        elif "default" in field and field["default"] != info.default:
            problems.append(f"{name}: default {field['default']!r} != {info.default!r}")
    return problems


@pytest.mark.parametrize(("name", "model"), RECORD_MODELS, ids=[n for n, _ in RECORD_MODELS])
def test_model_matches_avsc(name: str, model: type[Model]) -> None:
    assert differences(model, registry.read_avsc(name)) == []


@pytest.mark.parametrize("enum_type", events.ENUM_TYPES, ids=lambda e: e.__name__)
def test_enum_matches_avsc(enum_type: type[enum.StrEnum]) -> None:
    avsc = registry.read_avsc(f"{registry.NAMESPACE}.{enum_type.__name__}")
    assert avsc["type"] == "enum"
    assert avsc["symbols"] == [m.value for m in enum_type]
    assert avsc.get("doc")


def test_every_avsc_file_has_a_model() -> None:
    names = {p.name.removesuffix(".avsc") for p in registry.AVRO_DIR.glob("*.avsc")}
    enums = {f"{registry.NAMESPACE}.{e.__name__}" for e in events.ENUM_TYPES}
    assert names == set(registry.MODEL_BY_NAME) | enums


def test_envelope_union_lists_every_event_type() -> None:
    envelope = registry.read_avsc(f"{registry.NAMESPACE}.Envelope")
    body = next(f for f in envelope["fields"] if f["name"] == "body")
    assert body["type"] == [registry.full_name(m) for m in events.EVENT_TYPES]
    assert envelope["fields"][-1]["name"] == "hash", "log.codec needs hash to be the last field"


# --- the comparison itself must catch a field added to one side only ----------------------------


def test_a_field_added_only_to_the_model_is_caught() -> None:
    avsc = registry.read_avsc("agentlog.SessionFailed")
    widened = create_model(
        "SessionFailed",
        __base__=events.SessionFailed,
        retries=(int, Field(description="new field, model side only")),
    )
    assert any("only in model ['retries']" in p for p in differences(widened, avsc))


def test_a_field_added_only_to_the_avsc_is_caught() -> None:
    avsc = json.loads(json.dumps(registry.read_avsc("agentlog.SessionFailed")))
    avsc["fields"].append({"name": "retries", "type": "long", "doc": "new field, avsc side only"})
    assert any("only in avsc ['retries']" in p for p in differences(events.SessionFailed, avsc))


def test_a_changed_type_or_doc_is_caught() -> None:
    avsc = json.loads(json.dumps(registry.read_avsc("agentlog.SessionFailed")))
    avsc["fields"][0]["type"] = "bytes"
    avsc["fields"][1]["doc"] = "something else"
    problems = differences(events.SessionFailed, avsc)
    assert any("reason: avsc type" in p for p in problems)
    assert any("error_type: doc differs" in p for p in problems)


def test_envelope_model_matches() -> None:
    assert differences(Envelope, registry.read_avsc("agentlog.Envelope")) == []
