"""The web console's logins, as data (pure: the clock and the randomness are the caller's).

A login is a cookie ``payload.signature``: the payload is the user, the role (``operator``
may write, ``auditor`` only reads), the expiry and a random nonce, in URL-safe base64 JSON;
the signature is HMAC-SHA256 of the payload under the console's secret. Nothing is stored on
the server, so a restart keeps logins as long as the secret stays; a forged or edited cookie
fails the signature, an old one its expiry.

Each form carries a CSRF token, HMAC of the login's nonce: a page of another site can make a
browser post to the console with its cookie, but cannot read the token off the console's pages.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["COOKIE", "Login", "Role", "check_csrf", "check_password", "csrf_token", "issue", "verify"]

COOKIE = "agentlog_console"
DEFAULT_TTL_S = 8 * 3600.0


class Role(StrEnum):
    OPERATOR = "operator"
    """Reads, and approves, denies, retries or marks done tool calls."""
    AUDITOR = "auditor"
    """Reads only."""


@dataclass(frozen=True, slots=True)
class Login:
    user: str
    role: Role
    expires_at: float
    nonce: str

    @property
    def can_write(self) -> bool:
        return self.role is Role.OPERATOR


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sign(secret: bytes, payload: str) -> str:
    return _b64(hmac.new(secret, payload.encode(), hashlib.sha256).digest())


def issue(secret: bytes, login: Login) -> str:
    """The cookie value for ``login``."""
    body = {"u": login.user, "r": login.role.value, "e": login.expires_at, "n": login.nonce}
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    return f"{payload}.{_sign(secret, payload)}"


def verify(secret: bytes, cookie: str | None, now: float) -> Login | None:
    """The login a cookie carries, or None: missing, forged, malformed or expired."""
    if not cookie or cookie.count(".") != 1:
        return None
    payload, signature = cookie.split(".")
    if not hmac.compare_digest(_sign(secret, payload), signature):
        return None
    try:
        body = json.loads(_unb64(payload))
        login = Login(str(body["u"]), Role(body["r"]), float(body["e"]), str(body["n"]))
    except (ValueError, KeyError, TypeError):
        return None  # signed by us, so only an older format: treat as logged out
    return login if now < login.expires_at else None


def csrf_token(secret: bytes, login: Login) -> str:
    return _sign(secret, f"csrf:{login.nonce}")


def check_csrf(secret: bytes, login: Login, token: str | None) -> bool:
    return bool(token) and hmac.compare_digest(csrf_token(secret, login), token or "")


def check_password(given: str, expected: str | None) -> bool:
    """``given`` equals the configured password (compared in constant time); never with none configured."""
    if not expected:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())
