"""Tools whose service is down or whose answer is lost, for tests/integration/test_tool_outage.py.

A plugin: ``AGENTLOG_PLUGINS=tests.integration.outage_tools``. Each counts its runs in a file
under the sandbox, so the test reads how often the executor ran it.
"""

from __future__ import annotations

from typing import Any

from services.sdk import OutcomeUnknown, ToolUnavailable, tool


def _count(ctx: Any, name: str) -> int:
    marker = ctx.sandbox / f"{name}.{ctx.session_id}.runs"
    marker.parent.mkdir(parents=True, exist_ok=True)
    runs = int(marker.read_text()) + 1 if marker.exists() else 1
    marker.write_text(str(runs))
    return runs


@tool(name="always_down", effect="irreversible", schema={"type": "object"})
async def always_down(args: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Its service never answers: nothing happens, ever."""
    raise ToolUnavailable(f"the service is down (run {_count(ctx, 'always_down')})")


@tool(name="lossy_lookup", effect="idempotent", schema={"type": "object"})
async def lossy_lookup(args: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Its first answer is lost; being idempotent, it may simply run again."""
    runs = _count(ctx, "lossy_lookup")
    if runs == 1:
        raise OutcomeUnknown("the answer was lost")
    return {"runs": runs}
