"""A travel agent on agentlog's SDK: a program, an idempotent tool, an irreversible tool, a voter.

The program asks the model for a plan, searches flights (idempotent: a retry
after a crash is the same search), checkpoints, forks one branch per hotel to
get quotes (each branch is its own session), books the cheapest flight that
fits the budget (irreversible: held until an operator approves it, run exactly
once) and asks the model for a summary. The voter ``budget_guard`` refuses a
booking over the session's budget before anyone is asked to approve it; the
program then reports the refusal as its output.

Run it (docs/sdk.md, examples/travel_agent/README.md):

    logctl up --plugins examples.travel_agent.agent
    logctl run travel_agent --args '{"goal": "...", "to": "LIS", "budget_cents": 30000}'
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

from services.sdk import Context, Proposal, ToolError, abstain, approve, program, reject, tool, voter

AIRLINES = ("TAP", "Iberia", "Lufthansa")
HOTELS = ("Casa do Rio", "Hotel Central")


@tool(
    name="search_flights",
    effect="idempotent",
    schema={
        "type": "object",
        "properties": {"to": {"type": "string", "pattern": "^[A-Z]{3}$"}, "day": {"type": "string"}},
        "required": ["to"],
        "additionalProperties": False,
    },
)
def search_flights(args: dict[str, Any], ctx: Any) -> list[dict[str, Any]]:
    """Fares for a destination (a stand-in for a fares API: the same question, the same answer)."""
    base = zlib.crc32(f"{args['to']}/{args.get('day', '')}".encode())
    return [
        {
            "flight": f"{code[:2].upper()}{(base >> i) % 900 + 100}",
            "airline": code,
            "price_cents": 9000 + (base >> (3 * i)) % 30000,
        }
        for i, code in enumerate(AIRLINES)
    ]


@tool(
    name="quote_hotel",
    effect="pure",
    schema={
        "type": "object",
        "properties": {"hotel": {"type": "string"}, "nights": {"type": "integer", "minimum": 1}},
        "required": ["hotel", "nights"],
    },
)
async def quote_hotel(args: dict[str, Any], ctx: Any) -> dict[str, Any]:
    nightly = 6000 + zlib.crc32(args["hotel"].encode()) % 9000
    return {"hotel": args["hotel"], "total_cents": nightly * int(args["nights"])}


@tool(
    name="book_flight",
    effect="irreversible",
    schema={
        "type": "object",
        "properties": {"flight": {"type": "string"}, "price_cents": {"type": "integer", "minimum": 1}},
        "required": ["flight", "price_cents"],
        "additionalProperties": False,
    },
)
async def book_flight(args: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Book a flight: one line in the sandbox's bookings ledger per execution (a duplicate would show)."""
    ledger = ctx.sandbox / "bookings.jsonl"
    ledger.parent.mkdir(parents=True, exist_ok=True)
    line = {"key": ctx.idempotency_key, "session": ctx.session_id, **args}
    with ledger.open("a") as out:
        out.write(json.dumps(line, sort_keys=True) + "\n")
        out.flush()
        os.fsync(out.fileno())
    return {"confirmation": f"BK-{zlib.crc32(ctx.idempotency_key.encode()):08x}", **args}


@voter(name="budget_guard")
def budget_guard(proposal: Proposal) -> Any:
    """A booking must fit the session's budget (``budget_cents``)."""
    if proposal.tool != "book_flight":
        return abstain("not a booking")
    budget = int(proposal.session.args.get("budget_cents", 0))
    price = int(proposal.arguments.get("price_cents", 0))
    if price > budget:
        return reject(f"{price} cents is over the budget of {budget}")
    return approve(f"{price} of {budget} cents")


@program(name="travel_agent")
async def travel_agent(ctx: Context) -> dict[str, Any]:
    goal = ctx.args.get("goal", "Plan a trip.")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a travel agent. Be brief."},
        {"role": "user", "content": goal},
    ]
    plan = await ctx.llm(messages=messages, tools=[_spec(search_flights), _spec(book_flight)], max_tokens=32)
    messages.append(plan.message)

    flights = await ctx.tool("search_flights", {"to": ctx.args.get("to", "LIS")})
    messages.append({"role": "tool", "name": "search_flights", "content": json.dumps(flights)})
    await ctx.checkpoint()  # a point to restore or fork from: the search is done

    hotels = await ctx.fork([{"hotel": name} for name in HOTELS])
    if hotels.is_branch:  # in a branch: quote one hotel, that is the branch's output
        assert hotels.branch is not None
        return await ctx.tool("quote_hotel", {"hotel": hotels.branch["hotel"], "nights": ctx.args.get("nights", 2)})
    hotel = min(hotels.results.values(), key=lambda quote: quote["total_cents"])

    cheapest = min(flights, key=lambda flight: flight["price_cents"])
    try:
        booking = await ctx.tool("book_flight", {"flight": cheapest["flight"], "price_cents": cheapest["price_cents"]})
    except ToolError as refused:  # a voter or an operator said no: report it instead of booking
        return {"booking": None, "refused": refused.result.error, "hotel": hotel}
    messages.append({"role": "tool", "name": "book_flight", "content": json.dumps(booking)})
    summary = await ctx.llm(messages=messages, max_tokens=16)
    return {"booking": booking, "hotel": hotel, "summary": summary.text}


def _spec(t: Any) -> dict[str, Any]:
    """The OpenAI function spec of a tool, for the model."""
    return {
        "type": "function",
        "function": {"name": t.name, "description": t.spec.description, "parameters": t.spec.args_schema},
    }
