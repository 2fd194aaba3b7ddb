"""Every role's event ids, pinned: recovery depends on them (an append done again must get
the same id), so they may not change when the code that computes them moves."""

from __future__ import annotations

import pytest

from services.cache.manager import decision_event_id
from workers.cache_manager import CacheManagerWorker
from workers.decider import DeciderWorker
from workers.engine_bridge.core import EngineBridge, kv_event_id
from workers.executor import ExecutorWorker
from workers.planner import PlannerWorker
from workers.runtime import event_id

pytestmark = pytest.mark.unit


def test_session_roles_name_their_appends_as_they_always_did() -> None:
    assert event_id("s-1", "verdict", "call-7") == "47b3c319-afc3-5f3b-bfed-d141d1ba2f90"
    assert event_id("s-1", "start") == "f7ffb4b3-a061-5e0f-af62-08c9f811a76b"
    assert event_id("s-1", "end", "r2") == "7da15617-5e0d-51f4-b809-c97a293eb4f5"
    for role in (PlannerWorker, DeciderWorker, ExecutorWorker):
        assert role.event_ids("s-1", "verdict", "call-7") == event_id("s-1", "verdict", "call-7")


def test_the_engine_bridge_names_kv_events_as_it_always_did() -> None:
    assert kv_event_id("sim-0", "ep-abc", 12, 3) == "7dc86d20-ecc3-508d-872c-e75a5cfcdc3c"
    assert EngineBridge.event_ids("sim-0", "ep-abc", 12, 3) == kv_event_id("sim-0", "ep-abc", 12, 3)


def test_the_cache_managers_scheme_is_the_one_its_service_computes() -> None:
    assert decision_event_id("trig-1", "gap", "s-1") == "81dc1590-e7f1-5152-9507-c7c43936c509"
    assert CacheManagerWorker.event_ids("trig-1", "gap", "s-1") == decision_event_id("trig-1", "gap", "s-1")


def test_roles_of_different_kinds_never_share_ids() -> None:
    parts = ("a", "b", "c")
    ids = {PlannerWorker.event_ids(*parts), EngineBridge.event_ids(*parts), CacheManagerWorker.event_ids(*parts)}
    assert len(ids) == 3
