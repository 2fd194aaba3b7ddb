"""Kafka ACLs for the log's principals, as data (DESIGN.md sections 3 and 4).

Every process authenticates as its role (SASL/PLAIN user = role name) and the
broker's StandardAuthorizer, with ``allow.everyone.if.no.acl.found=false``, lets
it do only what this table grants. Who may *write* a topic comes from
``log.topics`` (each topic's only writer; everyone but the read-only auditor may
write the DLQ); who *reads* what is the role table of DESIGN.md section 4, with
the topic lists of ``workers/*.py``.

Per role:

- WRITE + DESCRIBE on the topics it owns (and ``agent.dlq``). Idempotent
  producers need no IDEMPOTENT_WRITE on the cluster: since KIP-679 the broker
  lets InitProducerId through for a principal with WRITE on any topic. The
  auditor has no WRITE anywhere, so it cannot even get a producer id.
- READ + DESCRIBE on the topics it reads. A writer reads its own topic too:
  ``SharedLog`` replays a partition before its first append to recover the
  chain.
- DESCRIBE on every other topic of the log: ``KafkaBackend.num_partitions``
  checks that *all* topics exist and are co-partitioned. DESCRIBE shows
  partition counts and offsets, never records.
- READ on its own consumer group (the role name, namespaced like topics). The
  operator and the auditor (``logctl``) make up group names, so they get
  PREFIXED group ACLs: ``<role>`` and ``logctl-``.
- DESCRIBE on the group librdkafka's partition scanners name
  (``log.kafka_backend.SCAN_GROUP``): the client looks its coordinator up, though a scanner
  never joins it; without it a scan fails when that answer comes first (seen in the compose
  stack: ``logctl run`` reading ``ops.commands``).
- WRITE + DESCRIBE on transactional ids prefixed by its role name (none for the
  auditor).

``admin`` is the broker's super user and has no ACLs: it creates topics and ACLs.

Names are physical: with a namespace ``ns``, topic ``agent.actions`` is
``ns.agent.actions`` and group ``planner`` is ``ns.planner``, as in
``log.kafka_backend``. ACLs of one namespace grant nothing in another.

CLI::

    python -m log.acls show [--namespace NS]
    python -m log.acls apply --credentials credentials.json [--namespace NS] [--partitions N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafka.admin import (  # type: ignore[import-untyped,unused-ignore]
    ACL,
    ACLFilter,
    ACLOperation,
    ACLPermissionType,
    ACLResourcePatternType,
    KafkaAdminClient,
    ResourcePattern,
    ResourcePatternFilter,
    ResourceType,
)

from log import topics as topic_table
from log.kafka_backend import SCAN_GROUP

ADMIN = "admin"
"""The super user (``super.users=User:admin``): creates topics and ACLs; has no ACLs itself."""

LOGCTL_GROUP_PREFIX = "logctl-"
"""Prefix of the throwaway consumer groups ``logctl`` makes (``logctl-tail-…``, ``logctl-read-…``)."""

ALL_TOPICS: tuple[str, ...] = tuple(t.name for t in topic_table.TOPICS)

_ACTIONS = topic_table.AGENT_ACTIONS.name
_VERDICTS = topic_table.AGENT_VERDICTS.name
_EFFECTS = topic_table.AGENT_EFFECTS.name
_KV_EVENTS = topic_table.KV_EVENTS.name
_KV_DECISIONS = topic_table.KV_DECISIONS.name
_OPS = topic_table.OPS_COMMANDS.name
_DLQ = topic_table.AGENT_DLQ.name
_GATEWAY = topic_table.AGENT_GATEWAY.name


@dataclass(frozen=True)
class Role:
    """One principal: what it reads, which consumer groups it may use, whether it writes at all."""

    principal: str
    reads: tuple[str, ...]
    groups: tuple[str, ...] = ()
    """Consumer groups it may use, exactly these names (LITERAL)."""
    group_prefixes: tuple[str, ...] = ()
    """Consumer groups it may use, any name with one of these prefixes (PREFIXED)."""
    read_only: bool = False
    """No WRITE anywhere, not even the DLQ, and no transactional ids."""

    @property
    def writes(self) -> tuple[str, ...]:
        """The topics it may append to: the ones ``log.topics`` says it owns, and the DLQ."""
        if self.read_only:
            return ()
        return tuple(t.name for t in topic_table.TOPICS if t.allows_actor(self.principal))


ROLES: tuple[Role, ...] = (
    # kv.decisions: the cache manager's decisions about its sessions' KV, for routing (workers/cache_view.py)
    # and the warm credit of its priorities (services/scheduling.py). kv.events: which engine still holds
    # how much of a session's prefix (an engine evicts under pressure without any decision), for routing
    # (workers/cache_view.py KVEvents; by scan, no consumer group, every partition: blocks are per engine).
    Role("planner", (_ACTIONS, _VERDICTS, _EFFECTS, _OPS, _GATEWAY, _KV_DECISIONS, _KV_EVENTS), groups=("planner",)),
    Role("decider", (_ACTIONS, _OPS, _VERDICTS), groups=("decider",)),
    Role("executor", (_VERDICTS, _ACTIONS, _EFFECTS, _OPS, _GATEWAY), groups=("executor",)),
    Role("cache-manager", ALL_TOPICS, groups=("cache-manager",)),
    # One bridge per engine instance, each in its own group (``engine-bridge.<engine id>``): every
    # bridge must see every decision and apply those for its engine.
    Role("engine-bridge", (_KV_DECISIONS, _KV_EVENTS), group_prefixes=("engine-bridge",)),
    # The OpenAI-compatible gateway (workers/gateway) writes only agent.gateway and reads the
    # verdicts on the tool calls it proxies, and the actions to know which sessions are not its
    # own (docs/architecture.md, "The gateway"). kv.events and kv.decisions: with several engines it
    # routes as the planner does (workers/cache_view.py, by scan, no consumer group): what each engine
    # still holds of a session's prefix and what the cache manager discarded.
    Role("gateway", (_GATEWAY, _VERDICTS, _ACTIONS, _KV_DECISIONS, _KV_EVENTS), groups=("gateway",)),
    # ``logctl projector rebuild`` reads in a group of its own (``projector-rebuild-<id>``).
    Role("projector", ALL_TOPICS, groups=("projector",), group_prefixes=("projector-",)),
    Role("operator", ALL_TOPICS, group_prefixes=("operator", LOGCTL_GROUP_PREFIX)),
    Role("auditor", ALL_TOPICS, group_prefixes=("auditor", LOGCTL_GROUP_PREFIX), read_only=True),
)
"""DESIGN.md section 4, plus the operator and auditor of ``logctl``."""

BY_PRINCIPAL: dict[str, Role] = {r.principal: r for r in ROLES}
PRINCIPALS: tuple[str, ...] = (ADMIN, *BY_PRINCIPAL)
"""Every SASL user of a secure broker."""


@dataclass(frozen=True, order=True)
class Grant:
    """One ALLOW ACL, in plain strings: ``User:<principal>`` may ``operation`` on a resource, from any host.

    ``resource_type`` is a kafka-python ``ResourceType`` name (TOPIC, GROUP,
    TRANSACTIONAL_ID), ``operation`` an ``ACLOperation`` name, ``pattern`` an
    ``ACLResourcePatternType`` name (LITERAL or PREFIXED).
    """

    principal: str
    resource_type: str
    name: str
    operation: str
    pattern: str = "LITERAL"

    def to_acl(self) -> Any:
        """The kafka-python ``ACL`` for ``create_acls``."""
        return ACL(
            principal=f"User:{self.principal}",
            host="*",
            operation=ACLOperation[self.operation],
            permission_type=ACLPermissionType.ALLOW,
            resource_pattern=ResourcePattern(
                ResourceType[self.resource_type], self.name, ACLResourcePatternType[self.pattern]
            ),
        )

    @classmethod
    def from_acl(cls, acl: Any) -> Grant:
        """The Grant of a kafka-python ``ACL`` (as ``describe_acls`` returns them)."""
        principal = str(acl.principal)
        return cls(
            principal=principal.removeprefix("User:"),
            resource_type=ResourceType(acl.resource_pattern.resource_type).name,
            name=str(acl.resource_pattern.resource_name),
            operation=ACLOperation(acl.operation).name,
            pattern=ACLResourcePatternType(acl.resource_pattern.pattern_type).name,
        )


def physical(namespace: str, name: str) -> str:
    """A topic, group or transactional id name as Kafka sees it (``log.kafka_backend``'s rule)."""
    return f"{namespace}.{name}" if namespace else name


def role_grants(role: Role, namespace: str = "") -> list[Grant]:
    """The ACLs of one role."""
    p = role.principal
    out: set[Grant] = set()
    for t in role.writes:
        out.add(Grant(p, "TOPIC", physical(namespace, t), "WRITE"))
        out.add(Grant(p, "TOPIC", physical(namespace, t), "DESCRIBE"))
    for t in role.reads:
        out.add(Grant(p, "TOPIC", physical(namespace, t), "READ"))
        out.add(Grant(p, "TOPIC", physical(namespace, t), "DESCRIBE"))
    # KafkaBackend.num_partitions() looks up every topic of the log.
    for t in ALL_TOPICS:
        out.add(Grant(p, "TOPIC", physical(namespace, t), "DESCRIBE"))
    for g in role.groups:
        out.add(Grant(p, "GROUP", physical(namespace, g), "READ"))
    for g in role.group_prefixes:
        out.add(Grant(p, "GROUP", physical(namespace, g), "READ", "PREFIXED"))
    out.add(Grant(p, "GROUP", physical(namespace, SCAN_GROUP), "DESCRIBE"))
    if not role.read_only:
        for op in ("WRITE", "DESCRIBE"):
            out.add(Grant(p, "TRANSACTIONAL_ID", physical(namespace, p), op, "PREFIXED"))
    return sorted(out)


def desired_acls(namespace: str = "", roles: Iterable[Role] = ROLES) -> list[Grant]:
    """Every ACL of every role, sorted."""
    return sorted(g for role in roles for g in role_grants(role, namespace))


def apply_acls(admin: Any, namespace: str = "", *, timeout_s: float = 30) -> list[Grant]:
    """Create the desired ACLs with ``admin`` (a ``KafkaAdminClient`` of a super user); idempotent.

    Kafka ignores an ACL that already exists, so this can run on every ``init``.
    Raises the broker's error (e.g. ``ClusterAuthorizationFailedError`` for a
    principal that may not alter ACLs) if any ACL is refused. Returns what it applied.

    CreateAcls returns once the controller has committed them; the broker applies
    them when it has caught up with the metadata log, a moment later. So this waits
    until the broker lists them all (it authorizes from that same view), or raises
    TimeoutError after ``timeout_s``.
    """
    grants = desired_acls(namespace)
    result = admin.create_acls([g.to_acl() for g in grants])
    failed = result["failed"]
    if failed:
        first = failed[0]
        raise first if isinstance(first, BaseException) else first()
    deadline = time.monotonic() + timeout_s
    while missing := missing_acls(admin, namespace):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(missing)} ACLs not visible after {timeout_s}s, e.g. {missing[0]}")
        time.sleep(0.05)
    return grants


def describe_acls(admin: Any, namespace: str = "") -> list[Grant]:
    """The ALLOW ACLs the broker holds, as Grants, sorted; with a namespace, only that namespace's."""
    acl_filter = ACLFilter(
        principal=None,
        host=None,
        operation=ACLOperation.ANY,
        permission_type=ACLPermissionType.ANY,
        resource_pattern=ResourcePatternFilter(ResourceType.ANY, None, ACLResourcePatternType.ANY),
    )
    acls, _ = admin.describe_acls(acl_filter)  # raises the broker's error itself
    grants = (Grant.from_acl(a) for a in acls if a.permission_type == ACLPermissionType.ALLOW)
    if namespace:
        grants = (g for g in grants if g.name.startswith(f"{namespace}."))
    return sorted(grants)


def missing_acls(admin: Any, namespace: str = "") -> list[Grant]:
    """Desired ACLs the broker does not hold (empty when ``apply_acls`` has run)."""
    held = set(describe_acls(admin, namespace))
    return [g for g in desired_acls(namespace) if g not in held]


def admin_client(bootstrap: str, client_config: dict[str, Any]) -> Any:
    """A ``KafkaAdminClient`` (close it)."""
    return KafkaAdminClient(bootstrap_servers=bootstrap, client_id="agentlog-acls", **client_config)


async def init_secure_log(
    bootstrap: str,
    admin_config: dict[str, Any],
    *,
    namespace: str = "",
    num_partitions: int = topic_table.DEFAULT_PARTITIONS,
) -> list[Grant]:
    """Create the log's topics as the admin principal, then its ACLs. Idempotent."""
    from log.kafka_backend import KafkaBackend  # not needed by the pure table above

    backend = KafkaBackend(bootstrap, namespace=namespace, client_config=admin_config)
    await backend.create_topics(num_partitions)

    def apply() -> list[Grant]:
        admin = admin_client(bootstrap, admin_config)
        try:
            return apply_acls(admin, namespace)
        finally:
            admin.close()

    return await asyncio.to_thread(apply)


def format_table(grants: Sequence[Grant]) -> str:
    """A plain-text table of ACLs, one per line."""
    rows = [("principal", "resource", "name", "operation", "pattern")]
    rows += [(g.principal, g.resource_type, g.name, g.operation, g.pattern) for g in grants]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _admin_config_from(credentials: Path) -> tuple[str, dict[str, Any]]:
    data = json.loads(credentials.read_text())
    config = {
        "security_protocol": data["security_protocol"],
        "sasl_mechanism": data["sasl_mechanism"],
        "sasl_plain_username": ADMIN,
        "sasl_plain_password": data["users"][ADMIN],
    }
    return str(data["bootstrap_servers"]), config


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m log.acls", description="The log's Kafka ACLs.")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print the desired ACLs")
    show.add_argument("--namespace", default="")
    apply = sub.add_parser("apply", help="create topics and ACLs as the admin principal")
    apply.add_argument("--credentials", type=Path, required=True, help="credentials.json of log.local_kafka")
    apply.add_argument("--bootstrap", default=None, help="default: the one in the credentials file")
    apply.add_argument("--namespace", default="")
    apply.add_argument("--partitions", type=int, default=topic_table.DEFAULT_PARTITIONS)
    args = parser.parse_args(argv)
    if args.command == "show":
        print(format_table(desired_acls(args.namespace)))
        return 0
    bootstrap, config = _admin_config_from(args.credentials)
    grants = asyncio.run(
        init_secure_log(args.bootstrap or bootstrap, config, namespace=args.namespace, num_partitions=args.partitions)
    )
    print(f"{len(grants)} ACLs applied", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
