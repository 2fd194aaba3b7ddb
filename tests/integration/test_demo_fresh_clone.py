"""``logctl demo`` from a fresh clone with nothing beside it: the repository carries its own data.

The clone is of the committed HEAD (in CI, the submitted main): it lives alone in a temporary
folder, so a path that reaches outside the repository (a sibling ``shared/``, a machine path)
fails here. The demo runs on the embedded default log (no ``--log-url``), in a data directory
of its own, as a new user's first command would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHECKOUT = Path(__file__).resolve().parents[2]


def test_the_demo_runs_from_a_fresh_clone_on_the_embedded_log() -> None:
    # Not under pytest's 0700 temp root: the embedded server runs as its own user and must reach its data.
    root = Path(tempfile.mkdtemp(prefix="agentlog-fresh-"))
    root.chmod(0o755)
    try:
        clone = root / "agentlog"
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(CHECKOUT), str(clone)], check=True)
        assert sorted(p.name for p in root.iterdir()) == ["agentlog"]  # nothing beside it
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTLOG_", "KAFKA_"))}
        env |= {"PYTHONPATH": str(clone), "AGENTLOG_DATA_DIR": str(root / "data")}
        done = subprocess.run(
            [sys.executable, "-m", "cli.main", "demo", "--sessions", "4", "--arrival-rate", "2", "--json"],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        summary = result["summary"]
        assert summary["sessions"] == 4 and summary["finished"] == 4, summary
        assert summary["llm_calls"] > 4 and summary["tool_calls"] > 0
        # Every LLM call the log records was computed by the engine exactly once.
        assert result["engine"]["num_served"] == summary["llm_calls"]
    finally:
        subprocess.run(
            [sys.executable, "-m", "log.embedded", "stop", "--pgdata", str(root / "data" / "postgres")],
            capture_output=True,
            check=False,
        )
        shutil.rmtree(root, ignore_errors=True)
