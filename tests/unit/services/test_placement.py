"""The router's inputs from a session's folded log: where its prefix is, what sizes taught, the event."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from schemas import events as ev
from services.placement import Holding, learn, locate, prefix_on, routed
from services.session import SessionState, fold
from tests.unit.services.helpers import envelope

pytestmark = pytest.mark.unit


def started(call: str, engine: str, prompt: int) -> ev.LLMCallStarted:
    return ev.LLMCallStarted(
        call_id=call, turn=0, engine_id=engine, prompt_tokens=prompt, max_output_tokens=16, prompt_digest="d"
    )


def completed(call: str, engine: str, prompt: int, output: int = 10) -> ev.LLMCallCompleted:
    return ev.LLMCallCompleted(
        call_id=call, engine_id=engine, prompt_tokens=prompt, cached_tokens=0, output_tokens=output,
        output_text="", finish_reason="stop", queue_ms=0, prefill_ms=1, decode_ms=1,
    )  # fmt: skip


def route(call: str, engine: str, size: str = "large", attempt: int = 0) -> ev.EngineRouted:
    return ev.EngineRouted(
        call_id=call, request_id=f"s/{call}", attempt=attempt, engine_id=engine, reason="locality", detail="",
        router="locality", prompt_tokens=100, expected_cached_tokens=0, expected_recompute_tokens=100,
        model_size=size, size_reason="declared",
    )  # fmt: skip


def proposed(call: str) -> ev.ToolCallProposed:
    return ev.ToolCallProposed(
        call_id=call, tool="search", arguments_json="{}", effect_class=ev.EffectClass.PURE, idempotency_key="k"
    )


def session(*bodies: ev.Event, sid: str = "s") -> SessionState:
    start = ev.SessionStarted(program="script", args_json="{}")
    return fold(sid, [envelope(b, session=sid) for b in (start, *bodies)])


def test_the_prefix_is_on_the_engine_of_the_last_completed_call_with_its_context() -> None:
    state = session(
        started("llm-0", "e0", 100), completed("llm-0", "e0", 100), proposed("tool-1"),
        started("llm-2", "e1", 300), completed("llm-2", "e1", 300, output=20),
    )  # fmt: skip
    assert prefix_on(state) == {"e1": 320}
    assert prefix_on(state, dropped=["e1"]) == {}
    assert prefix_on(session()) == {}


def test_a_call_in_flight_does_not_move_the_prefix() -> None:
    state = session(started("llm-0", "e0", 100), completed("llm-0", "e0", 100), started("llm-2", "e1", 300))
    assert prefix_on(state) == {"e0": 110}


def test_a_fork_inherits_its_parents_prefix_and_engine() -> None:
    parent = session(started("llm-0", "e1", 200), completed("llm-0", "e1", 200), sid="p")
    fork = session(ev.ForkCreated(parent_session_id="p", checkpoint_id="c", cut={}), sid="f")
    fork.inherit(parent)
    assert prefix_on(fork) == {"e1": 210}


def two_calls() -> SessionState:
    return session(
        started("llm-0", "e0", 100), completed("llm-0", "e0", 100), proposed("tool-1"),
        started("llm-2", "e1", 300), completed("llm-2", "e1", 300, output=20),
    )  # fmt: skip


def test_kv_events_of_the_last_call_decide_what_its_engine_still_holds() -> None:
    state = two_calls()
    # The engine reported the call, then evicted part of the context under pressure: what it kept.
    located = locate(state, holdings={"e1": Holding(192, "llm-2")})
    assert located.cached == {"e1": 192}
    assert located.notes == ("kv.events: e1 kept 192 of its 320 context tokens",)
    # Evicted all of it: no engine holds it (the call goes where it is cheapest, not back there).
    assert locate(state, holdings={"e1": Holding(0, "llm-2")}).cached == {}
    # A later call's report also says the events of this one are in; more than the context is capped.
    assert prefix_on(state, holdings={"e1": Holding(999, "llm-4")}) == {"e1": 320}
    assert locate(state, holdings={"e1": Holding(320, "llm-2")}).notes == ()


def test_before_the_engine_reported_the_last_call_the_logs_belief_stands_there() -> None:
    state = two_calls()
    # Its events of llm-2 are not in yet (the bridge polls): an older report says nothing of after the call.
    assert prefix_on(state, holdings={"e1": Holding(96, "llm-0")}) == {"e1": 320}
    assert prefix_on(state, holdings={"e1": Holding(96, None)}) == {"e1": 320}
    assert prefix_on(state, holdings={"e1": Holding(96, "odd")}) == {"e1": 320}  # not comparable: not later


def test_an_engine_the_session_left_counts_for_the_prefix_it_still_holds() -> None:
    state = two_calls()
    located = locate(state, holdings={"e0": Holding(96, "llm-0")})
    assert located.cached == {"e0": 96, "e1": 320}
    assert located.notes == ("kv.events: e0 still holds 96 tokens of its context",)
    # A discard by the cache manager after the last call drops that engine, whatever the events say.
    discarded = locate(state, dropped=["e0"], holdings={"e0": Holding(96, "llm-0")})
    assert discarded.cached == {"e1": 320} and discarded.notes[-1] == "kv.decisions: discarded on e0"
    assert prefix_on(state, dropped=["e1"], holdings={"e1": Holding(320, "llm-2")}) == {}


def test_a_forks_first_call_goes_where_its_parents_events_say_the_prefix_is() -> None:
    parent = session(started("llm-0", "e1", 200), completed("llm-0", "e1", 200), sid="p")
    fork = session(ev.ForkCreated(parent_session_id="p", checkpoint_id="c", cut={}), sid="f")
    fork.inherit(parent)
    # The parent's holdings (the planner passes the owner's): it went on and ran on e0 as well; e1
    # evicted the tail of what the fork inherits.
    holdings = {"e0": Holding(400, "llm-2"), "e1": Holding(112, "llm-2")}
    assert prefix_on(fork, holdings=holdings) == {"e0": 210, "e1": 112}


def test_the_latest_route_of_a_call_wins_and_every_route_is_kept() -> None:
    state = session(route("llm-0", "e0"), started("llm-0", "e0", 100), route("llm-0", "e1", attempt=1))
    assert state.routes["llm-0"].engine_id == "e1"
    assert [r.engine_id for r in state.route_history] == ["e0", "e1"]


def test_an_operator_pin_is_folded_and_can_be_removed() -> None:
    state = session(ev.ModelPinRequested(author="ops", size="small", reason="cheap"))
    assert state.model_pin == "small"
    state.apply(envelope(ev.ModelPinRequested(author="ops", size=None, reason="done"), session="s"))
    assert state.model_pin is None and len(state.pins) == 2


@dataclass
class Recorder:
    rows: list[tuple[str, str, str, bool]]

    def record(self, program: str, step: str, size: str, retried: bool) -> None:
        self.rows.append((program, step, size, retried))


def test_a_finished_session_teaches_each_routed_step_and_whether_it_needed_a_retry() -> None:
    state = session(
        route("llm-0", "e1", "small"), started("llm-0", "e1", 100), completed("llm-0", "e1", 100),
        proposed("tool-1"), ev.ToolCallAborted(call_id="tool-1", votes=[], policy="unanimous", reason="bad args"),
        route("llm-2", "e0", "large"), started("llm-2", "e0", 100), completed("llm-2", "e0", 100),
        proposed("tool-3"), ev.ToolCallCommitted(call_id="tool-3", votes=[], policy="unanimous"),
        ev.ToolCallCompleted(call_id="tool-3", result_json="{}", result_tokens=1, duration_ms=1),
    )  # fmt: skip
    recorder = Recorder([])
    assert learn(state, recorder.record) == 0  # not finished: nothing learned yet
    state.apply(envelope(ev.SessionFinished(output_json="{}", num_llm_calls=2, num_tool_calls=2), session="s"))
    assert learn(state, recorder.record) == 2
    assert recorder.rows == [("script", "0", "small", True), ("script", "2", "large", False)]


def test_the_last_call_of_a_failed_session_counts_as_retried() -> None:
    state = session(
        route("llm-0", "e1", "small"), started("llm-0", "e1", 100), completed("llm-0", "e1", 100),
        ev.SessionFailed(reason="gave up", error_type="ProgramError"),
    )  # fmt: skip
    recorder = Recorder([])
    learn(state, recorder.record)
    assert recorder.rows == [("script", "0", "small", True)]


@dataclass(frozen=True)
class FakeRoute:
    engine_id: str
    reason: str
    expected_recompute_tokens: int


@dataclass(frozen=True)
class FakeSize:
    size: str
    reason: str


def test_the_event_says_what_the_planner_believed_and_a_failover_names_the_engine_it_left() -> None:
    body = routed(
        call_id="llm-2", request_id="s/llm-2", attempt=1, route=FakeRoute("e1", "least_loaded", 300),
        router="locality", prompt_tokens=300, cached={"e0": 250, "e1": 400}, size=FakeSize("small", "pinned"),
        failed_engine_id="e0", reason="failover",
    )  # fmt: skip
    assert (body.engine_id, body.reason, body.expected_cached_tokens, body.expected_recompute_tokens) == (
        "e1",
        "failover",
        300,  # at most the prompt
        300,
    )
    assert (body.model_size, body.size_reason, body.failed_engine_id, body.attempt) == ("small", "pinned", "e0", 1)


def test_the_events_notes_follow_the_routes_detail() -> None:
    @dataclass(frozen=True)
    class Detailed(FakeRoute):
        detail: str = "holds 192/330 tokens"

    body = routed(
        call_id="llm-2", request_id="s/llm-2", attempt=0, route=Detailed("e1", "locality", 138), router="locality",
        prompt_tokens=330, cached={"e1": 192}, size=FakeSize("large", "default"),
        notes=["kv.events: e1 kept 192 of its 320 context tokens"],
    )  # fmt: skip
    assert body.detail == "holds 192/330 tokens; kv.events: e1 kept 192 of its 320 context tokens"
    assert body.expected_cached_tokens == 192
