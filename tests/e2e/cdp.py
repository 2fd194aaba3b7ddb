"""A headless Chromium driven over the DevTools protocol, directly (no Playwright, no driver).

Debian's ``chromium`` package (``/usr/bin/chromium``, or ``AGENTLOG_CHROMIUM``) is started with
``--remote-debugging-port`` and a fresh profile, without its background network traffic (the
machine has no network to give it); one page target is driven through its websocket with
aiohttp (already a dependency): navigate, evaluate JavaScript, screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from cli.stack import free_port

__all__ = ["Browser", "chromium_path"]


def chromium_path() -> str | None:
    explicit = os.environ.get("AGENTLOG_CHROMIUM")
    if explicit:
        return explicit
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    return None


class Browser:
    def __init__(self, executable: str, width: int = 1280, height: int = 900) -> None:
        self.executable = executable
        self.size = (width, height)
        self._profile = tempfile.mkdtemp(prefix="agentlog-chromium-")
        self._proc: subprocess.Popen[bytes] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = 0

    def _launch(self, port: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                self.executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-default-apps", "--remote-allow-origins=*", f"--remote-debugging-port={port}",
                f"--user-data-dir={self._profile}", f"--window-size={self.size[0]},{self.size[1]}", "about:blank",
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    async def __aenter__(self) -> Browser:
        port = free_port()
        self._proc = self._launch(port)
        self._http = aiohttp.ClientSession()
        deadline = time.monotonic() + 60
        while True:
            try:
                async with self._http.get(f"http://127.0.0.1:{port}/json/list") as r:
                    pages = [t for t in await r.json() if t["type"] == "page"]
                if pages:
                    break
            except aiohttp.ClientError:
                pass
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit {self._proc.poll()})")
            await asyncio.sleep(0.2)
        self._ws = await self._http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=64 * 2**20)
        await self.send("Page.enable")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._profile, ignore_errors=True)

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self._ws is not None
        self._ids += 1
        me = self._ids
        await self._ws.send_str(json.dumps({"id": me, "method": method, "params": params or {}}))
        while True:
            message = json.loads((await asyncio.wait_for(self._ws.receive(), 60)).data)
            if message.get("id") == me:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    async def js(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 60) -> Any:
        """Poll a JavaScript expression until it is truthy (e.g. after a navigation)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = await self.js(expression)
            except RuntimeError:
                value = None  # the page is between two documents
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression} stayed false for {timeout_s:g} s")
            await asyncio.sleep(0.2)

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", {"url": url})
        await self.wait_for(f"document.readyState === 'complete' && location.href.startsWith({json.dumps(url)})")

    async def location(self) -> str:
        return str(await self.js("location.pathname + location.search"))

    async def screenshot(self, path: Path, max_height: int = 2400) -> None:
        metrics = await self.send("Page.getLayoutMetrics")
        size = metrics.get("cssContentSize") or metrics["contentSize"]
        clip = {"x": 0, "y": 0, "width": self.size[0], "height": min(size["height"], max_height), "scale": 1}
        shot = await self.send("Page.captureScreenshot", {"format": "png", "clip": clip, "captureBeyondViewport": True})
        await asyncio.to_thread(_write, path, base64.b64decode(shot["data"]))


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
