"""Compile ``log.native.COMPILED`` and ``services.cache.COMPILED`` with mypyc (``make install`` runs this).

Each of ``log``'s modules is compiled on its own into ``log/_native/``, from a copy that
carries the SHA-256 of its source (``SOURCE_DIGEST``), so ``log.native`` can tell a current
build from a stale one. ``services.cache``'s are compiled together, under their own names,
into ``services/cache/_native/`` with the digests of their sources in ``SOURCES.json``
(``log.native.package_builds``). Builds happen in a temporary directory holding only what
mypy needs to check the modules; only the extension modules are copied into the tree.
Without a C compiler or mypyc this prints why and exits 0: agentlog then runs the same
modules, interpreted.

Usage: python scripts/compile_native.py [--check]   (--check: exit 1 unless every build is current)
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# A stale build is what this script replaces: log.native's warning about it (importing
# services.cache below checks its build) is not news here.
logging.getLogger("log.native").setLevel(logging.ERROR)

import services.cache  # noqa: E402
from log.native import COMPILED, GROUP_DIGESTS, group_digests, module, package_builds, source_digest  # noqa: E402

LOG = ROOT / "log"
OUT = LOG / "_native"
# What mypy reads beside each compiled module to check it (its imports inside log/).
SUPPORT = {"body_reader": ["body_writer.py"], "head_reader": [], "body_writer": []}


CACHE = ROOT / "services" / "cache"
CACHE_GROUP = "services.cache.compiled"  # the group's shared library: services/cache/_native/compiled__mypyc*


def current() -> list[str]:
    """The builds missing or stale: log's module names, and ``services.cache`` for the group."""
    stale = [name for name in COMPILED if module(name, compiled=True).__name__ != f"log._native.{name}"]
    if not package_builds(CACHE, services.cache.COMPILED):
        stale.append("services.cache")
    return stale


def build_cache_group() -> None:
    """``services.cache.COMPILED`` compiled together (calls between them are native calls)."""
    names = services.cache.COMPILED
    digests = group_digests(CACHE, names)  # of the sources copied below
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    out = CACHE / "_native"
    with tempfile.TemporaryDirectory(prefix="agentlog-native-") as tmp:
        work = Path(tmp)
        ignore = shutil.ignore_patterns("__pycache__", "_native", "*.so")
        for package in ("schemas", "services"):  # what mypy follows from services.cache, with log.native
            shutil.copytree(ROOT / package, work / package, ignore=ignore)
        (work / "log").mkdir()
        (work / "log" / "__init__.py").write_text("")
        shutil.copy(LOG / "native.py", work / "log" / "native.py")
        paths = [f"services/cache/{name}.py" for name in names]
        (work / "setup.py").write_text(
            "from setuptools import setup\nfrom mypyc.build import mypycify\n"
            f"setup(name='agentlog-cache', ext_modules=mypycify({paths!r}, group_name={CACHE_GROUP!r}))\n"
        )
        subprocess.run(
            [sys.executable, "setup.py", "build_ext", "--inplace"], cwd=work, check=True, stdout=subprocess.DEVNULL
        )  # fmt: skip
        if out.exists():
            shutil.rmtree(out)
        out.mkdir()
        for built in (work / "services" / "cache").glob(f"*{suffix}"):
            shutil.copy(built, out / built.name)
    (out / GROUP_DIGESTS).write_text(json.dumps(digests, indent=1) + "\n")  # last: a build cut short is no build


def build(name: str) -> None:
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    with tempfile.TemporaryDirectory(prefix="agentlog-native-") as tmp:
        work = Path(tmp)
        (work / "log" / "_native").mkdir(parents=True)
        (work / "log" / "__init__.py").write_text("")
        (work / "log" / "_native" / "__init__.py").write_text("")
        for support in SUPPORT[name]:
            shutil.copy(LOG / support, work / "log" / support)
        source = (LOG / f"{name}.py").read_text()
        (work / "log" / "_native" / f"{name}.py").write_text(f"{source}\n\nSOURCE_DIGEST = {source_digest(name)!r}\n")
        subprocess.run(
            [sys.executable, "-m", "mypyc", f"log/_native/{name}.py"],
            cwd=work, check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        for stale in OUT.glob(f"{name}*{suffix}"):
            stale.unlink()
        for built in (work / "log" / "_native").glob(f"{name}*{suffix}"):
            shutil.copy(built, OUT / built.name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 unless every build is current")
    args = parser.parse_args()
    missing = current()
    if args.check:
        if missing:
            print(f"not built or stale: {', '.join(missing)}", file=sys.stderr)
            return 1
        return 0
    for name in missing:
        if name == "services.cache":
            try:
                build_cache_group()
            except (OSError, subprocess.CalledProcessError) as e:
                print(f"compile_native: services/cache not compiled ({e}); it runs interpreted", file=sys.stderr)
                continue
            print("compile_native: services/cache compiled into services/cache/_native/")
            continue
        try:
            build(name)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"compile_native: log/{name}.py not compiled ({e}); it runs interpreted", file=sys.stderr)
            continue
        print(f"compile_native: log/{name}.py compiled into log/_native/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
