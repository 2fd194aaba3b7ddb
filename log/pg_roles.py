"""The roles of DESIGN.md section 4 on the Postgres backend: one database role per principal.

The same table as the Kafka ACLs (``log.acls.ROLES``), enforced by Postgres:

- INSERT only on the tables of the topics the role owns (and ``agent.dlq``);
  SELECT on the tables of the topics it reads (and its own);
- no role gets UPDATE, DELETE or TRUNCATE on any log table, and a trigger
  rejects them even for the tables' owner (``log.postgres_backend``);
- offsets are taken by updating ``log_heads``: row-level security lets a role
  update only the rows of the topics it may write;
- consumer group rows (offsets, members) are row-level secured to the role's
  own groups (the role name, or its prefixes for the operator and auditor).

Role names are ``agentlog_<principal>`` (``cache-manager`` -> ``agentlog_cache_manager``).
The admin (the database owner who runs ``logctl init --secure``) creates them.
"""

from __future__ import annotations

from collections.abc import Mapping

import asyncpg

from log.acls import ROLES, Role
from log.postgres_backend import table_name

LOG_TABLES_EXTRA = ("log_meta", "log_heads")


def role_name(principal: str) -> str:
    return "agentlog_" + principal.replace("-", "_")


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _group_condition(role: Role) -> str:
    terms = [f"group_id = {_literal(g)}" for g in role.groups]
    terms += [f"group_id LIKE {_literal(p.replace('%', '') + '%')}" for p in role.group_prefixes]
    return " OR ".join(terms) or "false"


def statements(schema: str, passwords: Mapping[str, str]) -> list[str]:
    """The SQL that creates the roles and their grants in ``schema`` (idempotent)."""
    s = _quote(schema)
    sql = [
        f"ALTER TABLE {s}.log_heads ENABLE ROW LEVEL SECURITY",
        f"ALTER TABLE {s}.log_group_offsets ENABLE ROW LEVEL SECURITY",
        f"ALTER TABLE {s}.log_group_members ENABLE ROW LEVEL SECURITY",
    ]
    for role in ROLES:
        name = role_name(role.principal)
        q = _quote(name)
        password = passwords[role.principal]
        sql.append(
            f"DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = {_literal(name)}) THEN "
            f"CREATE ROLE {q} LOGIN PASSWORD {_literal(password)}; "
            f"ELSE ALTER ROLE {q} LOGIN PASSWORD {_literal(password)}; END IF; END $$"
        )
        sql.append(f"GRANT USAGE ON SCHEMA {s} TO {q}")
        sql.append(f"GRANT SELECT ON {s}.log_meta, {s}.log_heads TO {q}")
        for topic in sorted(set(role.reads) | set(role.writes)):
            sql.append(f"GRANT SELECT ON {s}.{table_name(topic)} TO {q}")
        for topic in role.writes:
            sql.append(f"GRANT INSERT ON {s}.{table_name(topic)} TO {q}")
        if role.writes:
            sql.append(f"GRANT UPDATE ON {s}.log_heads TO {q}")
            writes = ", ".join(_literal(t) for t in role.writes)
            for command in ("SELECT", "UPDATE"):
                policy = _quote(f"{name}_{command.lower()}_heads")
                condition = "true" if command == "SELECT" else f"topic IN ({writes})"
                sql.append(f"DROP POLICY IF EXISTS {policy} ON {s}.log_heads")
                sql.append(f"CREATE POLICY {policy} ON {s}.log_heads FOR {command} TO {q} USING ({condition})")
        else:
            policy = _quote(f"{name}_select_heads")
            sql.append(f"DROP POLICY IF EXISTS {policy} ON {s}.log_heads")
            sql.append(f"CREATE POLICY {policy} ON {s}.log_heads FOR SELECT TO {q} USING (true)")
        groups = _group_condition(role)
        for table in ("log_group_offsets", "log_group_members"):
            sql.append(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.{table} TO {q}")
            policy = _quote(f"{name}_{table}")
            sql.append(f"DROP POLICY IF EXISTS {policy} ON {s}.{table}")
            sql.append(f"CREATE POLICY {policy} ON {s}.{table} TO {q} USING ({groups}) WITH CHECK ({groups})")
    return sql


async def apply_roles(dsn: str, schema: str, passwords: Mapping[str, str]) -> None:
    """Create (or update) every role and grant, as the database owner."""
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('agentlog:roles'))")
            for statement in statements(schema, passwords):
                await conn.execute(statement)
    finally:
        await conn.close()


def dsn_for(dsn: str, principal: str, password: str) -> str:
    """``dsn`` with the user and password of ``principal``'s role (works for URLs with or without a user)."""
    from urllib.parse import quote, urlsplit, urlunsplit

    parts = urlsplit(dsn)
    host = parts.netloc.rsplit("@", 1)[-1]
    netloc = f"{quote(role_name(principal))}:{quote(password)}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
