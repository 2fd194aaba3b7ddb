"""What the engine recorder keys answers by (services/engine/record.py)."""

from __future__ import annotations

import pytest

from services.engine.record import MAX_REQUEST_ID, RECORD_FIELD, mark_replayed, request_id_of

pytestmark = pytest.mark.unit


def test_the_header_names_the_call_before_the_body() -> None:
    assert request_id_of({"X-Request-Id": "s1/llm-2"}, {"request_id": "other"}) == "s1/llm-2"
    assert request_id_of({}, {"request_id": "s1/llm-2"}) == "s1/llm-2"


def test_a_request_without_an_id_is_not_recorded() -> None:
    assert request_id_of({}, {"prompt": "hi"}) is None
    assert request_id_of({}, None) is None
    assert request_id_of({}, [1, 2]) is None


@pytest.mark.parametrize("bad", ["", "   ", 7, ["a"], "x" * (MAX_REQUEST_ID + 1)])
def test_an_id_that_cannot_name_a_call_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="request_id"):
        request_id_of({}, {"request_id": bad})


def test_a_replay_is_marked_and_the_record_is_left_as_it_was() -> None:
    recorded = {"choices": [{"text": "hi"}], "usage": {"prompt_tokens": 3}}
    replay = mark_replayed(recorded, 12.5)
    assert replay[RECORD_FIELD] == {"replayed": True, "recorded_at": 12.5}
    assert replay["choices"] == recorded["choices"]
    assert RECORD_FIELD not in recorded
