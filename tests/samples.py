"""Sample values for every schema model, built from the model's own field types.

Used by round-trip tests and by tests that need "one of each" event.
"""

from __future__ import annotations

import types
import typing
from datetime import UTC, datetime
from enum import Enum
from typing import Any

from schemas.events import Model


def sample_value(annotation: Any, salt: int = 0) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return sample_value(args[0], salt)
    if origin is list:
        return [sample_value(typing.get_args(annotation)[0], salt + i) for i in range(2)]
    if origin is dict:
        return {f"k{salt}": sample_value(typing.get_args(annotation)[1], salt)}
    if annotation is str:
        return f"text-{salt}-é"
    if annotation is bool:
        return salt % 2 == 0
    if annotation is int:
        return 1_000_000_007 * (salt + 1)
    if annotation is float:
        return 0.25 + salt
    if annotation is bytes:
        return bytes([salt % 256]) * 5 + b"\x00\xff"
    if annotation is datetime:
        return datetime(2026, 1, 2, 3, 4, 5, 6789, tzinfo=UTC)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        members = list(annotation)
        return members[salt % len(members)]
    if isinstance(annotation, type) and issubclass(annotation, Model):
        return sample(annotation, salt)
    raise TypeError(f"no sample for {annotation!r}")


def sample(model: type[Model], salt: int = 0) -> Any:
    """An instance of ``model`` with every field set (optional ones too)."""
    hints = typing.get_type_hints(model)
    return model(**{name: sample_value(hints[name], salt + i) for i, name in enumerate(model.model_fields)})
