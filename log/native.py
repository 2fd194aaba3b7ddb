"""The codec's hot readers and writer compiled, where they were built from the current sources.

Decoding a record is the log's largest cost per event, and most of it is reading bytes
in Python: the envelope's head (``log.head_reader``) and the body (``log.body_reader``);
encoding one is mostly writing them (``log.body_writer``). ``scripts/compile_native.py``,
which ``make install`` runs, compiles those three modules with mypyc (it comes with mypy,
a dev dependency; it needs a C compiler) into ``log/_native/``: the same source, about
twice as fast (docs/benchmarks.md).

A package's modules can be compiled as one group, where they call each other: the cache
manager's pure core (``services.cache``, the fold and eviction search of every cache
event). Its modules keep their names, so every import of them gets the build or none does
(two copies of a class would not compare); the package puts ``package_builds``'s answer
first on its ``__path__``.

Where nothing was built (no compiler, a plain ``pip install``), or the build is of
another version of the source (each build carries the SHA-256 of the file it was made
from), the modules run as they are, with the same results: one implementation, compiled
or not. ``AGENTLOG_NATIVE=0`` turns the builds off (to compare, or to rule them out).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import types
from collections.abc import Sequence
from pathlib import Path

__all__ = ["COMPILED", "GROUP_DIGESTS", "group_digests", "module", "package_builds", "source_digest"]

COMPILED = ("head_reader", "body_reader", "body_writer")
"""The modules of ``log`` that ``scripts/compile_native.py`` compiles."""

_HERE = Path(__file__).parent
_log = logging.getLogger(__name__)
_warned: set[str] = set()


def source_digest(name: str) -> str:
    """SHA-256 of ``log/<name>.py`` as it is now (what a current build was made from)."""
    return hashlib.sha256((_HERE / f"{name}.py").read_bytes()).hexdigest()


def module(name: str, *, compiled: bool | None = None) -> types.ModuleType:
    """``log.<name>``: its build in ``log/_native`` if there is a current one and ``compiled``
    (default: unless ``AGENTLOG_NATIVE=0``), else the module itself."""
    if name not in COMPILED:
        raise ValueError(f"log.{name} is not one of the compiled modules ({', '.join(COMPILED)})")
    plain = importlib.import_module(f"log.{name}")
    if compiled is None:
        compiled = os.environ.get("AGENTLOG_NATIVE", "1") != "0"
    if not compiled:
        return plain
    try:
        built = importlib.import_module(f"log._native.{name}")
    except ImportError:
        return plain
    if getattr(built, "SOURCE_DIGEST", None) != source_digest(name):
        if name not in _warned:
            _warned.add(name)
            _log.warning("log/_native holds a build of another log/%s.py: reading without it (make install)", name)
        return plain
    return built


GROUP_DIGESTS = "SOURCES.json"
"""In a group's ``_native`` folder: the SHA-256 of each source it was built from."""


def group_digests(package_dir: Path, names: Sequence[str]) -> dict[str, str]:
    """SHA-256 of ``package_dir/<name>.py`` for each of ``names``, as they are now."""
    return {name: hashlib.sha256((package_dir / f"{name}.py").read_bytes()).hexdigest() for name in names}


def package_builds(package_dir: Path, names: Sequence[str]) -> list[str]:
    """``[package_dir/_native]`` where it holds a build of ``names`` made together from their
    current sources (``scripts/compile_native.py`` writes their digests there) and builds are on
    (``AGENTLOG_NATIVE``), else ``[]``; a stale build is warned of once and not used."""
    if os.environ.get("AGENTLOG_NATIVE", "1") == "0":
        return []
    folder = package_dir / "_native"
    try:
        built = json.loads((folder / GROUP_DIGESTS).read_text())
    except (OSError, ValueError):
        return []  # nothing built here
    if built != group_digests(package_dir, names):
        if str(folder) not in _warned:
            _warned.add(str(folder))
            _log.warning("%s holds a build of other sources: running without it (make install)", folder)
        return []
    return [str(folder)]
