"""Several engines' configuration, health and load (workers/engines/pool.py)."""

from __future__ import annotations

import pytest

from workers.engines.http import HttpEngine
from workers.engines.pool import EnginePool, EngineSpec, parse_engines

pytestmark = pytest.mark.unit


def test_engines_parse_from_the_environment_form_and_from_repeated_flags() -> None:
    text = "sim-0=http://h:8100/; sim-1=http://h:8101,size=small,model=tiny,prefill=2"
    specs = parse_engines(text)
    assert specs == [
        EngineSpec("sim-0", "http://h:8100", "large", "sim-0", None, 1.0),
        EngineSpec("sim-1", "http://h:8101", "small", "tiny", None, 2.0),
    ]
    assert parse_engines(["sim-0=http://h:8100", "sim-1=http://h:8101,size=small"])[1].size == "small"
    assert parse_engines("") == [] and parse_engines([]) == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("sim-0", "expected ID=http"),
        ("sim-0=h:8100", "expected ID=http"),
        ("sim-0=http://h:1,size=huge", "size must be small or large"),
        ("sim-0=http://h:1,colour=red", "unknown option"),
        ("sim-0=http://h:1,kind=tpu", "kind must be one of"),
        ("sim-0=http://h:1,prefill=fast", "prefill must be a number"),
        ("sim-0=http://h:1;sim-0=http://h:2", "unique"),
    ],
)
def test_a_bad_entry_is_refused_in_one_line_naming_it(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        parse_engines(text)
    assert "\n" not in str(error.value)


def test_the_pool_has_a_client_per_engine_and_tracks_health_and_this_planners_load() -> None:
    pool = EnginePool.create(parse_engines("a=http://h:1;b=http://h:2,size=small"), kind="sim")
    assert isinstance(pool.client("a"), HttpEngine) and pool.client("b").engine_id == "b"
    pool.begin("a", 300)
    pool.begin("a", 200)
    pool.end("a", 300)
    pool.mark_down("b", now=100.0)
    assert not pool.healthy("b", 105.0) and pool.healthy("b", 100.0 + pool.down_s)
    assert pool.sizes(105.0) == ("large",) and pool.sizes(200.0) == ("small", "large")
    pool.mark_up("b")
    assert pool.healthy("b", 105.0)
    assert pool.queued == {"a": 200}
    with pytest.raises(ValueError, match="no engines"):
        EnginePool.create([])


def _pool() -> EnginePool:
    specs = [EngineSpec("sim-0", "http://h:8100"), EngineSpec("sim-1", "http://h:8101")]
    return EnginePool(specs, clients={}, down_s=10.0)  # the gateway's pool: URLs, no clients


def test_choose_routes_to_the_holder_and_a_down_holder_is_a_failover() -> None:
    from services.routing import CallRequest, make_router

    pool, router = _pool(), make_router("locality")
    call = CallRequest("s", 100, {"sim-1": 90})
    route, failed = pool.choose(router, call, 0.0)
    assert (route.engine_id, route.reason, failed) == ("sim-1", "locality", None)
    assert pool.knows("sim-1") and pool.url("sim-1") == "http://h:8101" and not pool.knows("sim-2")
    pool.mark_down("sim-1", 0.0)
    route, failed = pool.choose(router, call, 1.0)
    assert (route.engine_id, route.reason, failed) == ("sim-0", "failover", "sim-1")
    assert route.expected_recompute_tokens == 100
    # The engine the last attempt could not reach is named by the caller.
    route, failed = pool.choose(router, CallRequest("t", 10), 1.0, failed="sim-1")
    assert (route.engine_id, failed) == ("sim-0", "sim-1")


def test_a_down_engine_holding_less_of_the_prefix_than_the_chosen_one_is_no_failover() -> None:
    from services.routing import CallRequest, make_router

    # kv.events: the session moved to sim-0 (its whole context there); the dead sim-1 still holds
    # the older, shorter prefix it had before: going on with sim-0 leaves nothing.
    pool, router = _pool(), make_router("locality")
    pool.mark_down("sim-1", 0.0)
    route, failed = pool.choose(router, CallRequest("s", 100, {"sim-0": 90, "sim-1": 40}), 1.0)
    assert (route.engine_id, route.reason, failed) == ("sim-0", "only", None)
    route, failed = pool.choose(router, CallRequest("s", 100, {"sim-0": 40, "sim-1": 90}), 1.0)
    assert (route.engine_id, route.reason, failed) == ("sim-0", "failover", "sim-1")


def test_choose_tries_all_engines_when_all_are_marked_down_but_the_one_that_just_failed() -> None:
    from services.routing import CallRequest, make_router

    pool, router = _pool(), make_router("locality")
    pool.mark_down("sim-0", 0.0)
    pool.mark_down("sim-1", 0.0)
    route, failed = pool.choose(router, CallRequest("s", 10), 1.0, failed="sim-0")
    assert (route.engine_id, failed) == ("sim-1", "sim-0")
    route, _ = pool.choose(router, CallRequest("s", 10), 11.0)  # the marks ran out
    assert route.engine_id == "sim-0"
