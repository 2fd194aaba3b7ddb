"""How logctl fails: one line on stderr (what failed, what to do), a non-zero exit code, no secret.

Exit codes (README, "logctl"):

- 1: the command failed or was refused (the log cannot be reached, no such session, ...);
- 2: bad input (an option that does not parse, an unsupported log URL) — as for a usage
  error — or gave up waiting (``run --timeout``, ``checkpoint`` / ``fork`` / ``restore`` /
  ``merge`` with no answer in time).

A bug still shows its traceback: only the failures an operator can act on are turned
into one line here, and every such line goes through ``log.redact`` first.
"""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperGroup

from log.errors import AgentLogError, BackendUnavailable, UnsupportedLogUrl
from log.redact import redact

FAILED = 1
BAD_INPUT = 2
TIMED_OUT = 2


class CliError(Exception):
    """A failure or refusal to show as one line, exiting with ``code``."""

    def __init__(self, message: str, code: int = FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def fail(message: str, code: int = FAILED) -> typer.Exit:
    """Print ``logctl: message`` (redacted) to stderr; returns the Exit to raise."""
    typer.echo(f"logctl: {redact(message)}", err=True)
    return typer.Exit(code)


class OneLineErrors(TyperGroup):
    """logctl's command group: the failures an operator can act on become one line (module doc)."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except CliError as e:
            raise fail(e.message, e.code) from None
        except UnsupportedLogUrl as e:
            raise fail(str(e), BAD_INPUT) from None
        except BackendUnavailable as e:
            raise fail(f"{e} (is it running? check --log-url or AGENTLOG_LOG_URL)") from None
        except AgentLogError as e:
            raise fail(f"{type(e).__name__}: {e}") from None
        except typer.BadParameter as e:
            if e.param is not None:
                raise  # a value click could not convert: it shows the usage with it
            raise fail(e.message, BAD_INPUT) from None  # a command refused its input
