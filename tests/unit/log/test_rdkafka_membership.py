"""log.rdkafka_backend: what a librdkafka member knows of its membership, from its statistics.

The reports are shaped as librdkafka 2.x writes them (the parts read here: ``ts``, ``cgrp``
and the ``GroupCoordinator`` connection's ``rxidle``, in microseconds).
"""

from __future__ import annotations

import json

import pytest

from log.backend import Membership
from log.kafka_backend import CONFIRMED_FOR_S
from log.rdkafka_backend import COORDINATOR_LOST_WARN_S, GroupWord, coordinator_lost, group_word, membership_of

pytestmark = pytest.mark.unit


def report(
    ts_s: float,
    *,
    state: str = "up",
    join_state: str = "steady",
    rxidle_s: float | None = 0.4,
    state_age_s: float = 5.0,
) -> str:
    brokers = {
        "127.0.0.1:9092/1": {"name": "127.0.0.1:9092/1", "nodeid": 1, "state": "UP", "rxidle": 100},
        "GroupCoordinator": {"name": "GroupCoordinator", "nodeid": -1, "state": "UP",
                             "rxidle": -1 if rxidle_s is None else int(rxidle_s * 1e6)},
    }  # fmt: skip
    cgrp = {"state": state, "stateage": int(state_age_s * 1000), "join_state": join_state, "rebalance_age": 4000,
            "rebalance_cnt": 1}  # fmt: skip
    return json.dumps({"name": "rdkafka#consumer-1", "type": "consumer", "ts": int(ts_s * 1e6), "brokers": brokers,
                       "cgrp": cgrp})  # fmt: skip


def test_a_report_gives_the_coordinators_last_answer_on_the_monotonic_clock() -> None:
    word = group_word(report(100.0, rxidle_s=0.4))
    assert word == GroupWord(at=100.0, up=True, steady=True, answered=pytest.approx(99.6), state_age_s=5.0)
    assert group_word(report(100.0, rxidle_s=None)).answered is None  # type: ignore[union-attr]
    assert group_word(report(100.0, state="wait-coord")).up is False  # type: ignore[union-attr]
    assert group_word(report(100.0, join_state="wait-join")).steady is False  # type: ignore[union-attr]


def test_a_group_long_without_its_coordinator_has_lost_it() -> None:
    """As a member stuck after broker pauses reported itself: ``query-coord`` for 52 s."""
    stuck = group_word(report(100.0, state="query-coord", join_state="init", state_age_s=52.0))
    assert coordinator_lost(stuck)
    looking = group_word(report(100.0, state="query-coord", state_age_s=COORDINATOR_LOST_WARN_S - 1))
    assert not coordinator_lost(looking)  # a broker restart's worth: it may still find it
    assert not coordinator_lost(group_word(report(100.0, state="up", state_age_s=600.0)))
    assert not coordinator_lost(None)  # no report yet


def test_a_report_without_a_group_says_nothing() -> None:
    assert group_word(json.dumps({"ts": 1, "type": "consumer", "brokers": {}})) is None


def test_confirmed_while_answered_in_doubt_once_not() -> None:
    word = group_word(report(100.0, rxidle_s=0.5))  # answered at 99.5
    assert membership_of(word, assigned_at=90.0, now=100.2) is Membership.CONFIRMED
    assert membership_of(word, assigned_at=90.0, now=99.5 + CONFIRMED_FOR_S - 0.01) is Membership.CONFIRMED
    # No newer report (the broker away, or this process paused): the answer only gets older.
    assert membership_of(word, assigned_at=90.0, now=99.5 + CONFIRMED_FOR_S + 0.01) is Membership.IN_DOUBT


def test_a_coordinator_out_of_reach_or_never_heard_is_in_doubt() -> None:
    for word in (group_word(report(100.0, state="wait-broker-transport")), group_word(report(100.0, rxidle_s=None))):
        assert membership_of(word, assigned_at=90.0, now=100.0) is Membership.IN_DOUBT


def test_a_rebalance_under_way_or_a_revocation_is_lost() -> None:
    assert membership_of(group_word(report(100.0, join_state="wait-join")), 90.0, 100.0) is Membership.LOST
    assert membership_of(group_word(report(100.0)), assigned_at=None, now=100.0) is Membership.LOST


def test_the_assignment_is_an_answer_and_outdates_the_reports_before_it() -> None:
    # The report before the assignment saw the rebalance; the assignment ended it.
    before = group_word(report(100.0, join_state="wait-sync", rxidle_s=3.0))
    assert membership_of(before, assigned_at=100.5, now=101.0) is Membership.CONFIRMED
    assert membership_of(None, assigned_at=100.5, now=101.0) is Membership.CONFIRMED
    assert membership_of(None, assigned_at=100.5, now=100.5 + CONFIRMED_FOR_S + 0.01) is Membership.IN_DOUBT
    # A later report's older answer does not undo the assignment's.
    after = group_word(report(101.0, rxidle_s=3.0))
    assert membership_of(after, assigned_at=100.5, now=101.0) is Membership.CONFIRMED
