"""``python -m workers.engine_bridge --engine sim|vllm --engine-id ID [engine options]``.

Loads ``workers.engine_bridge.<engine>`` (its ``add_arguments`` and ``create``) and runs
an ``EngineBridge`` as the ``engine-bridge`` principal (see ``workers.main``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

from log import SharedLog
from workers.engine_bridge.core import EngineBridge


def _engine_module(argv: list[str]) -> Any:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--engine", default="sim")
    known, _ = pre.parse_known_args(argv)
    return importlib.import_module(f"workers.engine_bridge.{known.engine}")


class BridgeWorker(EngineBridge):
    """``EngineBridge`` with the ``workers.main`` conventions (options, create)."""

    engine_module: Any = None

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--engine", default="sim", help="engine kind: a module of workers.engine_bridge")
        parser.add_argument(
            "--engine-id",
            default=os.environ.get("AGENTLOG_ENGINE_ID", "sim-0"),
            help="the engine instance (CacheDecisionMade.engine_id; default: AGENTLOG_ENGINE_ID, as the cache manager)",
        )
        BridgeWorker.engine_module.add_arguments(parser)

    @classmethod
    async def create(cls, log: SharedLog, args: argparse.Namespace) -> BridgeWorker:
        source, actuator = cls.engine_module.create(args)
        return cls(log, source, actuator, engine_id=args.engine_id, group=args.group, instance_id=args.instance_id)


def main(argv: list[str] | None = None) -> None:
    from workers.main import run_worker

    argv = sys.argv[1:] if argv is None else argv
    BridgeWorker.engine_module = _engine_module(argv)
    run_worker(BridgeWorker, argv)


if __name__ == "__main__":
    main()
