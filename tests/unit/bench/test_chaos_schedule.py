"""The chaos fault schedule is pure: the seed alone decides every fault and its time."""

from __future__ import annotations

import itertools

from bench.chaos_lib import BROKER_GAP_S, BROKER_KILL, BROKER_PAUSE, ENGINE_RESTART, ROLES, fault_schedule, kill


def test_same_seed_same_schedule_and_another_seed_another() -> None:
    assert fault_schedule(7, 100, 300.0) == fault_schedule(7, 100, 300.0)
    assert fault_schedule(7, 100, 300.0) != fault_schedule(8, 100, 300.0)


def test_the_counts_the_window_and_the_order() -> None:
    schedule = fault_schedule(3, 100, 300.0)
    assert len(schedule) == 100
    assert all(0 <= f.at_s <= 300.0 for f in schedule)
    assert [f.at_s for f in schedule] == sorted(f.at_s for f in schedule)
    kinds = {f.kind for f in schedule}
    assert kinds <= {kill(r) for r in ROLES} | {ENGINE_RESTART, BROKER_KILL, BROKER_PAUSE}
    assert {kill(r) for r in ROLES} <= kinds  # 90 role faults over 6 kinds: every role is hit


def test_broker_faults_one_in_ten_and_never_overlapping() -> None:
    schedule = fault_schedule(5, 100, 300.0)
    broker = [f for f in schedule if f.kind in (BROKER_KILL, BROKER_PAUSE)]
    assert len(broker) == 10
    assert {f.kind for f in broker} == {BROKER_KILL, BROKER_PAUSE}
    assert all(b.at_s - a.at_s >= BROKER_GAP_S * 3 / 4 for a, b in itertools.pairwise(broker))


def test_a_small_schedule_still_kills_the_broker() -> None:
    schedule = fault_schedule(1, 8, 40.0)
    assert len(schedule) == 8
    assert [f.kind for f in schedule].count(BROKER_KILL) == 1
