"""services.cache compiled (log.native.package_builds): a build of the current sources or none,
and the build decides as the sources do."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import services.cache
from log import native
from log.native import GROUP_DIGESTS, group_digests, package_builds

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[4]
NAMES = ("alpha", "beta")


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("AGENTLOG_NATIVE", raising=False)
    monkeypatch.setattr(native, "_warned", set())
    for name in NAMES:
        (tmp_path / f"{name}.py").write_text(f"NAME = {name!r}\n")
    return tmp_path


def build(package: Path, digests: dict[str, str]) -> Path:
    folder = package / "_native"
    folder.mkdir(exist_ok=True)
    (folder / GROUP_DIGESTS).write_text(json.dumps(digests))
    return folder


def test_a_build_of_the_current_sources_goes_first_on_the_path(package: Path) -> None:
    folder = build(package, group_digests(package, NAMES))
    assert package_builds(package, NAMES) == [str(folder)]


def test_no_build_leaves_the_path_as_it_is(package: Path) -> None:
    assert package_builds(package, NAMES) == []
    (package / "_native").mkdir()
    (package / "_native" / GROUP_DIGESTS).write_text("{not json")  # a build cut short
    assert package_builds(package, NAMES) == []


def test_a_build_of_other_sources_is_not_used(package: Path, caplog: pytest.LogCaptureFixture) -> None:
    build(package, group_digests(package, NAMES))
    (package / "beta.py").write_text("NAME = 'changed since the build'\n")
    with caplog.at_level(logging.WARNING, logger="log.native"):
        assert package_builds(package, NAMES) == []
        assert package_builds(package, NAMES) == []
    assert caplog.text.count("holds a build of other sources") == 1  # warned once


def test_a_build_of_fewer_modules_is_not_used(package: Path) -> None:
    build(package, group_digests(package, NAMES[:1]))
    assert package_builds(package, NAMES) == []


def test_builds_are_off_on_request(package: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build(package, group_digests(package, NAMES))
    monkeypatch.setenv("AGENTLOG_NATIVE", "0")
    assert package_builds(package, NAMES) == []


# The scale benchmark's workload, a slice: thousands of evictions and host displacements.
# Prints where the manager came from and every decision, scores and TTLs included.
DECIDE = """
import json, services.cache.manager as m
from bench.cache_manager_scale import config_for, workload
from services.cache import CachePolicy
events, mean_blocks = workload(6000, 500, seed=5)
manager = m.CacheManager(config_for(500, mean_blocks), CachePolicy())
out = [repr(d) for e in events for d in manager.apply(e.event_id, e.session_id, e.body, e.at)]
print(json.dumps({"file": m.__file__, "decisions": out}))
"""


def decide(compiled: bool) -> dict[str, object]:
    env = {**os.environ, "AGENTLOG_NATIVE": "1" if compiled else "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", DECIDE], env=env, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_compiled_and_interpreted_managers_decide_alike() -> None:
    # Without a build both sides run interpreted and this holds trivially; CI builds it
    # (make install) and checks with scripts/compile_native.py --check that it is current.
    compiled, interpreted = decide(compiled=True), decide(compiled=False)
    assert str(interpreted["file"]).endswith("services/cache/manager.py")
    if package_builds(Path(services.cache.__file__).parent, services.cache.COMPILED):
        assert "_native" in str(compiled["file"])
    decisions = compiled["decisions"]
    assert isinstance(decisions, list) and len(decisions) > 1000
    assert decisions == interpreted["decisions"]
