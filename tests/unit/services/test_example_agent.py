"""The example agent (examples/travel_agent) in the pure world of ``branch_world``: every step, the fork."""

from __future__ import annotations

import json
from typing import Any

from examples.travel_agent import agent as example
from schemas import events as ev
from services.session import SessionStatus
from tests.unit.services.branch_world import World


def request(world: World, session: str, name: str, args: dict[str, Any]) -> None:
    world.append(session, ev.SessionRequested(program=name, args_json=json.dumps(args), author="t"), "operator")


def test_the_example_travel_agent_runs_in_the_pure_world() -> None:
    world = World()
    world.programs["travel_agent"] = example.travel_agent
    for t in (example.search_flights, example.quote_hotel, example.book_flight):
        world.tools[t.name] = t.spec
    world.results["search_flights"] = [{"flight": "TP100", "price_cents": 100}, {"flight": "IB1", "price_cents": 90}]
    world.results["quote_hotel"] = {"total_cents": 5}
    request(world, "t", "travel_agent", {"goal": "a trip", "budget_cents": 1000})
    world.settle()
    state = world.state("t")
    assert state.status is SessionStatus.FINISHED, state.failure
    assert [s.call_id for s in state.steps] == ["llm-0", "tool-1", "ckpt-2", "fork-3", "tool-4", "llm-5"]
    assert state.tool_calls["tool-4"].arguments == {"flight": "IB1", "price_cents": 90}
    assert {world.state(f"t.fork-3.{i}").status for i in range(2)} == {SessionStatus.FINISHED}


def test_the_example_reports_a_refused_booking_instead_of_booking() -> None:
    world = World()
    world.programs["travel_agent"] = example.travel_agent
    for t in (example.search_flights, example.quote_hotel, example.book_flight):
        world.tools[t.name] = t.spec
    world.rejected.add("book_flight")  # as budget_guard refuses a booking over the budget
    world.results["search_flights"] = [{"flight": "TP100", "price_cents": 100}]
    world.results["quote_hotel"] = {"total_cents": 5}
    request(world, "t", "travel_agent", {"goal": "a trip", "budget_cents": 1})
    world.settle()
    output = json.loads(world.state("t").output_json or "")
    assert output["booking"] is None and output["refused"] == "aborted by the decider: refused"
    assert not [k for k in world.executions if k[1] == "tool-4"]
