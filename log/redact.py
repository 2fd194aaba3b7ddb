"""Keep secrets out of what people see: errors, log lines, ``--json`` output.

A log URL may carry a password (``postgresql://user:PASSWORD@host/db``, or
``?password=PASSWORD``). Wherever a URL is shown, show ``redact(url)``; the CLI
also passes every error message through it (the last line of defence, for text
that came from a library).
"""

from __future__ import annotations

import re

HIDDEN = "***"

# scheme://user:password@host  ->  scheme://user:***@host (the user name stays: it says who failed)
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/?#@\s]*):(?P<secret>[^/?#\s]*)@")
# ...?password=secret&... and password=secret in a key=value DSN
_PARAM = re.compile(r"(?P<head>\b(?:password|passwd|pwd|token|secret)=)(?P<secret>[^&\s'\"]+)", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with the password of every URL (and every ``password=`` value) replaced by ``***``."""
    text = _USERINFO.sub(lambda m: f"{m['head']}:{HIDDEN}@", text)
    return _PARAM.sub(lambda m: f"{m['head']}{HIDDEN}", text)
