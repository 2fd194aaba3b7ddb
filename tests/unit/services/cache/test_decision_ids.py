"""Decision event ids are RFC 4122 version-5 UUIDs of (trigger, kind, session)."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.cache.manager import NAMESPACE, decision_event_id

pytestmark = pytest.mark.unit


@given(st.text(max_size=80), st.sampled_from(["gap", "end", "ttl", "pressure"]), st.text(max_size=40))
def test_the_id_is_uuid5_of_trigger_kind_and_session(trigger: str, kind: str, session: str) -> None:
    expected = str(uuid.uuid5(NAMESPACE, f"{trigger}/{kind}/{session}"))
    assert decision_event_id(trigger, kind, session) == expected
    assert uuid.UUID(expected).version == 5
