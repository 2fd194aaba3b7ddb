"""The web console in a real browser: ``logctl up --projector --console --cache-manager`` on the
Postgres log, and Debian's headless Chromium driven over the DevTools protocol (``tests/e2e/cdp.py``).

It checks what an operator sees and does: the sessions list shows a session started during the
test; its timeline shows its LLM calls in the log's order; a payment held for approval is
approved by clicking the page's button, and the executor then pays exactly once (the ledger and
the log's ToolCallStarted count); a request without a login cannot approve. It writes
screenshots of the main pages (to docs/img/console-*.png with ``AGENTLOG_SCREENSHOTS=docs/img``,
which is how the docs' pictures are made; else under the test's temporary directory). It is also the integration test of
``logctl up --projector``: the projector it starts keeps the read model the console reads.

Skipped where no Chromium is installed, unless ``AGENTLOG_REQUIRE_CHROMIUM=1`` (``.ci/run``
installs Debian's package and sets it).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path

import aiohttp
import asyncpg
import pytest
from typer.testing import CliRunner

from cli.common import ensure_topics
from cli.main import app
from cli.stack import free_port
from log import open_log
from schemas import events as ev
from tests.e2e.cdp import Browser, chromium_path
from tests.logctl_up import logctl_up

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Screenshots go to the test's own directory, or to docs/img when regenerating the docs'
# pictures (AGENTLOG_SCREENSHOTS=docs/img): a test run never rewrites tracked files by default.
SCREENSHOTS_ENV = "AGENTLOG_SCREENSHOTS"
PASSWORD = "console-" + uuid.uuid4().hex
ECHO = {
    "steps": [
        {"llm": {"prompt_tokens": 96, "output_tokens": 8}},
        {"tool": "sleep", "arguments": {"seconds": 1}},
        {"llm": {"prompt_tokens": 160, "output_tokens": 8}},
        {"tool": "echo", "arguments": {"text": "hi"}},
        {"llm": {"prompt_tokens": 200, "output_tokens": 4}},
    ]
}
PAYMENT = {
    "steps": [
        {"llm": {"prompt_tokens": 40, "output_tokens": 4}},
        {"tool": "payment", "arguments": {"account": "acme", "amount_cents": 1200}},
        {"llm": {"prompt_tokens": 8, "output_tokens": 4}},
    ]
}


@pytest.fixture
def chromium() -> str:
    found = chromium_path()
    if found is None:
        if os.environ.get("AGENTLOG_REQUIRE_CHROMIUM") == "1":
            pytest.fail("AGENTLOG_REQUIRE_CHROMIUM=1 but no chromium is installed")
        pytest.skip("no chromium here (apt-get install chromium)")
    return found


async def _history(pg_url: str, namespace: str, session_id: str) -> list[ev.Event]:
    async with open_log(pg_url, actor="auditor", namespace=namespace) as log:
        return [e.body for e in await log.history(session_id)]


async def _paid(pg_url: str, session_id: str) -> int:
    conn = await asyncpg.connect(pg_url)
    try:
        exists = await conn.fetchval("SELECT to_regclass('agentlog_ledger.payments') IS NOT NULL")
        if not exists:
            return 0
        return int(
            await conn.fetchval("SELECT count(*) FROM agentlog_ledger.payments WHERE session_id = $1", session_id)
        )
    finally:
        await conn.close()


async def _browse(base: str, pg_url: str, namespace: str, chromium: str, run: str, pay: str, shots: Path) -> None:
    async with Browser(chromium) as page:
        # No login: the console sends the browser to its login form.
        await page.goto(f"{base}/")
        await page.wait_for("location.pathname === '/login'")
        await page.js(f"document.querySelector('input[name=password]').value = {json.dumps(PASSWORD)}")
        await page.js("document.querySelector('#login').click()")
        await page.wait_for("location.pathname === '/' && document.readyState === 'complete'")

        # The sessions list shows the session started during this test (once projected).
        row = f"tr[data-session='{run}']"
        for _ in range(150):
            if await page.js(
                f'!!document.querySelector("{row}") && document.querySelector("{row}").innerText.includes(\'finished\')'
            ):
                break
            await asyncio.sleep(0.4)
            await page.goto(f"{base}/")
        else:
            raise AssertionError(f"{run} never showed up finished in the sessions list")
        await page.screenshot(shots / "console-sessions.png")

        # Its timeline shows its LLM calls in the log's order.
        await page.js(f'document.querySelector("{row} a").click()')
        await page.wait_for(f"location.pathname === '/sessions/{run}' && document.readyState === 'complete'")
        bars = await page.js(
            "[...document.querySelectorAll('#timeline rect[data-lane=llm]')]"
            ".map(r => [r.dataset.ref, +r.dataset.start])"
        )
        logged = [b.call_id for b in await _history(pg_url, namespace, run) if isinstance(b, ev.LLMCallStarted)]
        assert [ref for ref, _ in bars] == logged and len(logged) == 3, (bars, logged)
        assert [s for _, s in bars] == sorted(s for _, s in bars)
        assert await page.js("document.querySelectorAll('#timeline rect[data-lane=gap]').length") == 2
        assert await page.js("document.querySelectorAll('#events tr').length") > 10
        await page.screenshot(shots / "console-session.png")

        # The held payment is waiting; a request without a login cannot approve it.
        button = f"button[data-action=APPROVE][data-call='{pay}/tool-1']"
        for _ in range(150):
            await page.goto(f"{base}/waiting")
            if await page.js(f'!!document.querySelector("{button}")'):
                break
            await asyncio.sleep(0.4)
        else:
            raise AssertionError("the payment never showed up waiting for approval")
        await page.screenshot(shots / "console-waiting.png")
        async with aiohttp.ClientSession() as anonymous:
            form = {"session_id": pay, "call_id": "tool-1", "decision": "APPROVE", "csrf": "x"}
            async with anonymous.post(f"{base}/decide", data=form) as r:
                assert r.status == 401, await r.text()
        history = await _history(pg_url, namespace, pay)
        assert not any(isinstance(b, ev.ApprovalGiven) for b in history)
        assert await _paid(pg_url, pay) == 0

        # Approved from the page: the executor pays exactly once.
        await page.js(f'document.querySelector("{button}").click()')
        await page.wait_for("location.search.includes('done=APPROVE')")
        for _ in range(150):
            history = await _history(pg_url, namespace, pay)
            if any(isinstance(b, ev.SessionFinished) for b in history):
                break
            await asyncio.sleep(0.4)
        else:
            raise AssertionError(f"the payment session did not finish: {[type(b).__name__ for b in history]}")
        approvals = [b for b in history if isinstance(b, ev.ApprovalGiven)]
        assert [(a.decision, a.author) for a in approvals] == [(ev.ApprovalDecision.APPROVE, "operator (console)")]
        assert sum(isinstance(b, ev.ToolCallStarted) and b.call_id == "tool-1" for b in history) == 1
        assert await _paid(pg_url, pay) == 1
        # The page answered at once with the list as projected then; it drops the call once the
        # projector has read the approval.
        for _ in range(150):
            await page.goto(f"{base}/waiting")
            if not await page.js(f'!!document.querySelector("{button}")'):
                break
            await asyncio.sleep(0.4)
        else:
            raise AssertionError("the approved payment is still listed as waiting")

        await page.goto(f"{base}/cache")
        await page.screenshot(shots / "console-cache.png")


def test_the_console_in_a_browser_approves_a_payment_once(
    pg_url: str, namespace: str, tmp_path: Path, chromium: str
) -> None:
    port = free_port()
    env = {
        **os.environ,
        "AGENTLOG_NAMESPACE": namespace,
        "AGENTLOG_LEDGER_URL": pg_url,
        "AGENTLOG_READ_MODEL_URL": pg_url,
        "AGENTLOG_CONSOLE_PASSWORD": PASSWORD,
        "USER": "operator",
    }
    ensure_topics(pg_url, namespace=namespace)
    flags = ["--time-scale", "0.05", "--work-dir", str(tmp_path), "--projector", "--console", "--console-port",
             str(port), "--cache-manager", "--gpu-blocks", "256"]  # fmt: skip
    with logctl_up(pg_url, *flags, env=env) as stack:
        assert {"projector", "console", "planner-0", "decider", "executor"} <= stack.names

        run, pay = f"web-{namespace}", f"pay-{namespace}"
        cli_env = {"AGENTLOG_NAMESPACE": namespace}
        started = CliRunner().invoke(
            app, ["run", "script", "--log-url", pg_url, "-n", "1", "--prefix", pay, "--no-wait", "--args",
                  json.dumps(PAYMENT)], env=cli_env,
        )  # fmt: skip
        assert started.exit_code == 0, started.output
        ran = CliRunner().invoke(
            app, ["run", "script", "--log-url", pg_url, "-n", "1", "--prefix", run, "--args", json.dumps(ECHO),
                  "--json"], env=cli_env,
        )  # fmt: skip
        assert ran.exit_code == 0, ran.output
        run, pay = f"{run}-0000", f"{pay}-0000"
        shots = Path(os.environ.get(SCREENSHOTS_ENV) or tmp_path / "screenshots")
        shots.mkdir(parents=True, exist_ok=True)
        asyncio.run(_browse(f"http://127.0.0.1:{port}", pg_url, namespace, chromium, run, pay, shots))
