"""Compile ``log.native.COMPILED`` with mypyc into ``log/_native/`` (``make install`` runs this).

Each module is compiled on its own, from a copy that carries the SHA-256 of its source
(``SOURCE_DIGEST``), so ``log.native`` can tell a current build from a stale one. The build
happens in a temporary directory holding only what mypy needs to check the module; only
the extension modules are copied into the tree. Without a C compiler or mypyc this prints
why and exits 0: agentlog then reads records with the same modules, interpreted.

Usage: python scripts/compile_native.py [--check]   (--check: exit 1 unless every build is current)
"""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from log.native import COMPILED, module, source_digest  # noqa: E402

LOG = ROOT / "log"
OUT = LOG / "_native"
# What mypy reads beside each compiled module to check it (its imports inside log/).
SUPPORT = {"body_reader": ["body_writer.py"], "head_reader": [], "body_writer": []}


def current() -> list[str]:
    """The compiled modules whose build is missing or stale."""
    return [name for name in COMPILED if module(name, compiled=True).__name__ != f"log._native.{name}"]


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
    # A stale build is what this script replaces: log.native's warning about it is not news here.
    logging.getLogger("log.native").setLevel(logging.ERROR)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 unless every build is current")
    args = parser.parse_args()
    missing = current()
    if args.check:
        if missing:
            print(f"not built or stale: {', '.join(f'log/{n}.py' for n in missing)}", file=sys.stderr)
            return 1
        return 0
    for name in missing:
        try:
            build(name)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"compile_native: log/{name}.py not compiled ({e}); it runs interpreted", file=sys.stderr)
            continue
        print(f"compile_native: log/{name}.py compiled into log/_native/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
