"""The chaos mix's resource tool: a plugin of the chaos stack (``AGENTLOG_PLUGINS=bench.chaos_tools``).

``chaos_hold`` acquires, through the executor (``ctx.resources``), what a sandboxed tool
typically makes: a scratch directory with a file in it, a helper process (``sleep 600``) and
a listening TCP port; then it holds them for ``seconds`` (times the stack's time scale), so
that an executor SIGKILL of the schedule can land while the tool runs. The session owns them:
the executor releases them when the session ends, and a restarted executor reclaims what a
killed one left.

The helper process carries ``AGENTLOG_CHAOS_TOOL=<tag>`` (the run's namespace) in its
environment: the run counts what is left on the machine by that tag, not by what the log says
(``bench/chaos_lib.py``, ``left_on_machine``).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from typing import Any

from services.sdk import tool

TAG = "AGENTLOG_CHAOS_TOOL"

SCHEMA = {
    "type": "object",
    "properties": {"tag": {"type": "string"}, "seconds": {"type": "number", "minimum": 0}},
    "required": ["tag"],
}


@tool(name="chaos_hold", effect="idempotent", schema=SCHEMA)
async def chaos_hold(args: dict[str, Any], ctx: Any) -> dict[str, Any]:
    scratch = await ctx.resources.directory()
    (scratch.path / "work.txt").write_text(ctx.call_id)
    helper = await ctx.resources.process(
        ["sleep", "600"],
        env={**os.environ, TAG: str(args["tag"])},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    port = await ctx.resources.port()
    await asyncio.sleep(float(args.get("seconds", 0.0)) * ctx.time_scale)
    return {"dir": str(scratch.path), "pid": helper.pid, "port": port.port}
