"""Tools that acquire resources through the executor.

A plugin: ``AGENTLOG_PLUGINS=tests.integration.resource_tools``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

from services.sdk import tool

# A process that ignores SIGTERM: only SIGKILL ends it.
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"
)


@tool(name="hold_all", effect="idempotent", schema={"type": "object"})
async def hold_all(args: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """A directory with a file in it, a temporary file, a process (and its child) and a TCP port."""
    directory = await ctx.resources.directory()
    (directory.path / "work.txt").write_text("scratch")
    temp = await ctx.resources.temp_file(".json")
    temp.path.write_text("{}")
    code = (
        STUBBORN
        if args.get("stubborn")
        else "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"
    )
    if args.get("stubborn"):
        lease = await ctx.resources.process([sys.executable, "-c", code], stdout=subprocess.PIPE)
        # Only once it says so does it ignore SIGTERM: a release before that would end it on SIGTERM.
        assert lease.process is not None and lease.process.stdout is not None
        ready = await asyncio.to_thread(lease.process.stdout.readline)
        if ready.strip() != b"ready":
            raise RuntimeError(f"the stubborn process did not start: {ready!r}")
        lease.process.stdout.close()
        process = lease.process
    else:
        process = (await ctx.resources.process([sys.executable, "-c", code], stdout=subprocess.DEVNULL)).process
    port = await ctx.resources.port()
    return {"dir": str(directory.path), "file": str(temp.path), "pid": process.pid, "port": port.port}


@tool(name="immutable", effect="idempotent", schema={"type": "object"})
async def immutable(args: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """A directory holding a file marked immutable (chattr +i): not even root may delete it."""
    directory = await ctx.resources.directory()
    locked = directory.path / "locked"
    locked.write_text("x")
    await asyncio.to_thread(subprocess.run, ["chattr", "+i", str(locked)], check=True)
    return {"dir": str(directory.path)}


@tool(name="early_release", effect="idempotent", schema={"type": "object"})
async def early_release(args: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Acquires a directory and releases it itself."""
    directory = await ctx.resources.directory()
    await ctx.resources.release(directory)
    await ctx.resources.release(directory)  # idempotent
    return {"dir": str(directory.path), "exists": directory.path.exists()}


@tool(name="container", effect="idempotent", schema={"type": "object", "properties": {"image": {"type": "string"}}})
async def container(args: dict[str, Any], ctx: Any) -> dict[str, Any]:
    lease = await ctx.resources.container(args.get("image", "busybox"), ["sleep", "600"])
    return {"container": lease.container}
