"""The console's login cookie and CSRF token (services/console_auth.py)."""

from __future__ import annotations

import pytest

from services.console_auth import Login, Role, check_csrf, check_password, csrf_token, issue, verify

pytestmark = pytest.mark.unit

SECRET = b"s" * 32
LOGIN = Login("ops", Role.OPERATOR, expires_at=1000.0, nonce="n1")


def test_a_cookie_round_trips_until_it_expires() -> None:
    cookie = issue(SECRET, LOGIN)
    assert verify(SECRET, cookie, 999.0) == LOGIN
    assert verify(SECRET, cookie, 1000.0) is None


@pytest.mark.parametrize(
    "cookie",
    [None, "", "no-dot", "a.b.c", "payload.signature", issue(b"other" * 8, LOGIN), issue(SECRET, LOGIN) + "x"],
)
def test_a_missing_forged_or_malformed_cookie_is_no_login(cookie: str | None) -> None:
    assert verify(SECRET, cookie, 0.0) is None


def test_an_edited_payload_fails_the_signature() -> None:
    payload, signature = issue(SECRET, Login("ops", Role.AUDITOR, 1000.0, "n1")).split(".")
    promoted = issue(SECRET, LOGIN).split(".")[0]
    assert verify(SECRET, f"{promoted}.{signature}", 0.0) is None
    assert verify(SECRET, f"{payload}.{signature}", 0.0) is not None


def test_csrf_is_bound_to_the_login() -> None:
    token = csrf_token(SECRET, LOGIN)
    assert check_csrf(SECRET, LOGIN, token)
    assert not check_csrf(SECRET, Login("ops", Role.OPERATOR, 1000.0, "n2"), token)
    assert (
        not check_csrf(SECRET, LOGIN, None) and not check_csrf(SECRET, LOGIN, "") and not check_csrf(SECRET, LOGIN, "x")
    )


def test_passwords() -> None:
    assert check_password("pw", "pw") and not check_password("pw", "pw2") and not check_password("", "pw")
    assert not check_password("", None) and not check_password("", ""), "no password configured: nobody logs in"
    assert LOGIN.can_write and not Login("a", Role.AUDITOR, 1.0, "n").can_write
