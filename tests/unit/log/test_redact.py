"""Passwords in URLs never reach a message."""

from __future__ import annotations

import pytest

from log.redact import redact

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("postgresql://bob:s3cret@db:5432/agentlog", "postgresql://bob:***@db:5432/agentlog"),
        ("postgres://bob:p@ss:w0rd@db/x", "postgres://bob:***@db/x"),  # an unencoded @ in the password
        ("cannot connect to postgresql://u:pw@h:1/x: refused", "cannot connect to postgresql://u:***@h:1/x: refused"),
        ("postgresql://bob@db/x?sslmode=require&password=s3cret", "postgresql://bob@db/x?sslmode=require&password=***"),
        ("host=db user=bob password=s3cret dbname=x", "host=db user=bob password=*** dbname=x"),
        ("kafka://127.0.0.1:9092", "kafka://127.0.0.1:9092"),  # a port is not a password
        ("postgresql://bob@db/x", "postgresql://bob@db/x"),
        ("a://x:1@y and b://z:2@w", "a://x:***@y and b://z:***@w"),
    ],
)
def test_redact_hides_passwords_and_keeps_the_rest(text: str, shown: str) -> None:
    assert redact(text) == shown
