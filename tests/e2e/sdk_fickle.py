"""A plugin for tests/e2e/test_sdk_agent.py: a program that reads its environment, so it changes its
mind when the planner restarts with another one (what a program must never do)."""

from __future__ import annotations

import os
from typing import Any

from services.sdk import Context, program


@program(name="fickle_agent")
async def fickle_agent(ctx: Context) -> dict[str, Any]:
    await ctx.llm(messages=[{"role": "user", "content": "where to?"}], max_tokens=8)
    flights = await ctx.tool("search_flights", {"to": os.environ.get("FICKLE_TO", "LIS")})
    await ctx.tool("book_flight", {"flight": flights[0]["flight"], "price_cents": 100})  # held: nobody approves
    return {}
