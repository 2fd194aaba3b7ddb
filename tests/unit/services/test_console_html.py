"""The console's pages as HTML (services/console_html.py): escaping, forms, read-only."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from services import console_html as pages
from services import console_views as views
from services.console_auth import Login, Role

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)
OPERATOR = Login("ops", Role.OPERATOR, 1e12, "n")
AUDITOR = Login("aud", Role.AUDITOR, 1e12, "n")
EVIL = "<script>alert(1)</script>"


def _waiting() -> list[views.Waiting]:
    return [views.Waiting("s", "tool-1", "payment", '{"a": "' + EVIL + '"}', "approval", T0, ("APPROVE", "DENY"))]


def test_values_from_the_log_are_escaped() -> None:
    summary = views.summarize({"session_id": "s", "program": EVIL, "started_at": T0}, T0)
    page = pages.sessions_page([summary], status="", program=EVIL, programs=[EVIL], login=OPERATOR, limit=10)
    assert EVIL not in page and "&lt;script&gt;" in page
    assert EVIL not in pages.waiting_page(_waiting(), login=OPERATOR, csrf="tok")
    assert EVIL not in pages.error_page(404, EVIL) and EVIL not in pages.login_page(EVIL, next_path=EVIL)


def test_an_operator_gets_forms_with_the_csrf_token_and_an_auditor_none() -> None:
    page = pages.waiting_page(_waiting(), login=OPERATOR, csrf="tok-123")
    assert page.count('name="csrf" value="tok-123"') == 2
    assert 'data-action="APPROVE"' in page and 'data-action="DENY"' in page and 'action="/decide"' in page
    read_only = pages.waiting_page(_waiting(), login=AUDITOR, csrf="tok-123")
    assert "tok-123" not in read_only and "/decide" not in read_only and "read-only" in read_only


def test_the_timeline_svg_has_a_rect_per_bar_in_its_lane() -> None:
    t = views.Timeline(
        T0, 2000.0,
        [views.Bar("llm", 0, 1000, "llm-0 (turn 0)", "d", "llm-0"), views.Bar("gap", 1000, 2000, "gap", "", "g")],
        [],
    )  # fmt: skip
    svg = pages.timeline_svg(t)
    assert svg.startswith('<svg id="timeline"') and svg.endswith("</svg>")
    assert 'data-lane="llm" data-ref="llm-0" data-start="0.0"' in svg and 'data-lane="gap"' in svg


def test_pages_render_empty() -> None:
    assert "no sessions" in pages.sessions_page([], status="", program="", programs=[], login=AUDITOR, limit=5)
    assert "nothing waiting" in pages.waiting_page([], login=OPERATOR, csrf="t")
    view = views.cache_view([], [], T0)
    assert "no cache decisions yet" in pages.cache_page(view, login=AUDITOR)
