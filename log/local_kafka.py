"""A real single-node Apache Kafka (KRaft) broker for tests and CI, without Docker.

The broker runs from Kafka's Maven Central jars, which Maven resolves once from
``log/broker/pom.xml`` (shipped in the package) into the user's cache directory
(``AGENTLOG_CACHE_DIR``, else the platform's, e.g. ``~/.cache/agentlog``), under
``kafka/libs``: an installed wheel starts a broker as a checkout does. Needs Java 17+
(and Maven, once).

Library use::

    with LocalKafkaBroker() as broker:
        producer = KafkaProducer(**broker.client_configs())

    with LocalKafkaBroker(secure=True) as broker:   # SASL/PLAIN + ACLs, see below
        producer = KafkaProducer(**broker.client_configs("planner"))

CLI use (``.ci/run``)::

    python -m log.local_kafka start --port 19092 --data-dir DIR --pid-file F [--secure]
    python -m log.local_kafka stop --pid-file F

Secure mode (``secure=True``, ``start --secure``): one listener CLIENT with
SASL_PLAINTEXT + PLAIN for clients, a SASL_PLAINTEXT controller listener that
only ``admin`` can log in to, Kafka's StandardAuthorizer with
``allow.everyone.if.no.acl.found=false`` and ``super.users=User:admin``. Every
principal of ``log.acls.PRINCIPALS`` is a user. Passwords are generated at the
first start (or given), kept in ``DATA_DIR/credentials.json`` (mode 0600, read
back on a restart) and one file per principal in ``DATA_DIR/secrets/`` (for
``AGENTLOG_KAFKA_PASSWORD_FILE``); they are never on a command line or in the
log. ``server.properties`` holds them too (the JAAS config) and is 0600. No
ACLs exist at start: ``log.acls.apply_acls`` creates them.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

# kafka-python ships no type information; pyproject.toml sets ignore_missing_imports for it,
# and "unused-ignore" keeps this line clean with or without that setting.
from kafka.admin import KafkaAdminClient  # type: ignore[import-untyped,unused-ignore]
from kafka.errors import KafkaError  # type: ignore[import-untyped,unused-ignore]

from log.acls import ADMIN, PRINCIPALS
from log.embedded import user_cache_dir

BROKER_FILES = Path(__file__).resolve().parent / "broker"
POM_FILE = BROKER_FILES / "pom.xml"
LOG4J_CONFIG = BROKER_FILES / "log4j2.properties"
DEFAULT_CACHE_DIR = user_cache_dir() / "kafka"
# kafka-server-start.sh defaults to 1 GiB; 512 MiB is plenty for tests once the log
# cleaner's dedupe buffer is shrunk (see properties()).
DEFAULT_HEAP = ("-Xms256m", "-Xmx512m")
HOST = "127.0.0.1"
# Pinned: an unpinned `dependency:copy-dependencies` may resolve an old plugin version.
_MVN_GOAL = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies"
_LOG_TAIL_LINES = 40
CREDENTIALS_FILE = "credentials.json"
SECRETS_DIR = "secrets"
SECURITY_PROTOCOL = "SASL_PLAINTEXT"
SASL_MECHANISM = "PLAIN"
AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
# Kafka's JAAS parser takes user_<name>= option names; a password sits in double quotes.
_PRINCIPAL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_PASSWORD_RE = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no space


class KafkaBrokerError(RuntimeError):
    """The broker could not be resolved, formatted, started or stopped."""


def resolve_jars(cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """Download the broker's runtime jars into ``cache_dir/libs`` once; return it."""
    libs = cache_dir / "libs"
    marker = libs / ".complete"
    # The marker holds the pom's hash, so a version bump re-resolves instead of putting
    # two Kafka versions on one classpath.
    digest = hashlib.sha256(POM_FILE.read_bytes()).hexdigest()
    if marker.is_file() and marker.read_text().strip() == digest:
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        msg = f"Maven (mvn) is needed once to fetch the Kafka jars into {libs}"
        raise KafkaBrokerError(msg)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Parallel test processes may get here together: one resolves, the others wait.
    with (cache_dir / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file() and marker.read_text().strip() == digest:
            return libs
        shutil.rmtree(libs, ignore_errors=True)  # stale or half-copied
        # Maven works beside its pom (target/): a copy in the cache, not the package's own
        # file, which may sit in a read-only site-packages.
        pom = cache_dir / "pom.xml"
        shutil.copyfile(POM_FILE, pom)
        cmd = [
            mvn, "-B", "-q", "-Dstyle.color=never", "-f", str(pom), _MVN_GOAL,
            "-DincludeScope=runtime", f"-DoutputDirectory={libs}",
        ]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise KafkaBrokerError(
                f"{' '.join(cmd)} failed with exit code {result.returncode}:\n{result.stdout}{result.stderr}"
            )
        marker.write_text(digest + "\n")
    return libs


@dataclass(frozen=True)
class KafkaCredentials:
    """Where a secure broker listens and every principal's password (``credentials.json``)."""

    bootstrap_servers: str
    passwords: Mapping[str, str] = field(repr=False)
    path: Path | None = None
    """The credentials.json these were read from or written to."""

    def client_configs(self, principal: str = ADMIN) -> dict[str, Any]:
        """SASL settings of kafka-python clients that log in as ``principal``, without the
        bootstrap address: ``KafkaBackend(bootstrap, client_config=...)`` takes these."""
        if principal not in self.passwords:
            raise KeyError(f"no user {principal!r}; users are {', '.join(self.passwords)}")
        return {
            "security_protocol": SECURITY_PROTOCOL,
            "sasl_mechanism": SASL_MECHANISM,
            "sasl_plain_username": principal,
            "sasl_plain_password": self.passwords[principal],
        }

    def client_kwargs(self, principal: str = ADMIN) -> dict[str, Any]:
        """All kwargs of a kafka-python client: ``KafkaProducer(**creds.client_kwargs("planner"))``."""
        return {"bootstrap_servers": self.bootstrap_servers, **self.client_configs(principal)}

    def password_file(self, principal: str) -> Path:
        """The file holding only ``principal``'s password (for ``AGENTLOG_KAFKA_PASSWORD_FILE``)."""
        if self.path is None:
            raise ValueError("credentials not saved to a file")
        return self.path.parent / SECRETS_DIR / principal

    def env(self, principal: str) -> dict[str, str]:
        """Environment for a process that logs in as ``principal`` (read by ``kafka_backend.security_config``)."""
        return {
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap_servers,
            "AGENTLOG_KAFKA_USERNAME": principal,
            "AGENTLOG_KAFKA_PASSWORD_FILE": str(self.password_file(principal)),
        }

    @classmethod
    def load(cls, path: Path) -> KafkaCredentials:
        data = json.loads(path.read_text())
        return cls(str(data["bootstrap_servers"]), dict(data["users"]), path)

    def save(self, path: Path) -> KafkaCredentials:
        """Write ``path`` (0600) and ``secrets/<principal>`` (0600, in a 0700 folder) next to it."""
        data = {
            "bootstrap_servers": self.bootstrap_servers,
            "security_protocol": SECURITY_PROTOCOL,
            "sasl_mechanism": SASL_MECHANISM,
            "users": dict(self.passwords),
        }
        _write_private(path, json.dumps(data, indent=2) + "\n")
        folder = path.parent / SECRETS_DIR
        folder.mkdir(mode=0o700, exist_ok=True)
        folder.chmod(0o700)
        for principal, password in self.passwords.items():
            _write_private(folder / principal, password + "\n")
        return KafkaCredentials(self.bootstrap_servers, self.passwords, path)


class LocalKafkaBroker:
    """One combined broker+controller KRaft node on 127.0.0.1, RF=1: plaintext, or SASL/PLAIN with ACLs."""

    def __init__(
        self,
        port: int = 0,
        controller_port: int = 0,
        data_dir: Path | None = None,
        heap: Sequence[str] = DEFAULT_HEAP,
        extra_properties: Mapping[str, str] | None = None,
        cache_dir: Path = DEFAULT_CACHE_DIR,
        detach: bool = False,
        secure: bool = False,
        passwords: Mapping[str, str] | None = None,
    ) -> None:
        """Port 0 picks a free port. ``detach`` puts the JVM in its own session so it
        outlives this Python process (and a Ctrl-C in its terminal).

        ``secure``: SASL/PLAIN and the StandardAuthorizer (see the module doc).
        ``passwords`` sets some or all principals' passwords (extra names become
        users too); the others are kept from an earlier start in ``data_dir`` or
        generated."""
        free = _free_ports(2)
        self.port = port or free[0]
        self.controller_port = controller_port or free[1]
        self._owns_data_dir = data_dir is None
        self.data_dir = Path(tempfile.mkdtemp(prefix="kafka-")) if data_dir is None else data_dir
        self.heap = tuple(heap)
        self.extra_properties = dict(extra_properties or {})
        self.cache_dir = cache_dir
        self.detach = detach
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0
        self.secure = secure
        self._passwords: dict[str, str] = {}
        if secure:
            self._passwords = _resolve_passwords(self.data_dir / CREDENTIALS_FILE, passwords)
        elif passwords:
            raise ValueError("passwords need secure=True")

    @property
    def bootstrap_servers(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "broker.log"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def credentials_file(self) -> Path:
        return self.data_dir / CREDENTIALS_FILE

    @property
    def credentials(self) -> KafkaCredentials:
        """Bootstrap address and passwords of a secure broker (saved at start)."""
        if not self.secure:
            raise ValueError("a plaintext broker has no credentials")
        return KafkaCredentials(self.bootstrap_servers, dict(self._passwords), self.credentials_file)

    def client_configs(self, principal: str | None = None) -> dict[str, Any]:
        """kwargs for kafka-python clients; a secure broker's log in as ``principal`` (default admin)."""
        if not self.secure:
            return {"bootstrap_servers": self.bootstrap_servers}
        return self.credentials.client_kwargs(principal or ADMIN)

    def properties(self) -> dict[str, str]:
        """server.properties: a single node (plaintext, or secure), then ``extra_properties`` on top."""
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            # Static voters, as the apache/kafka image uses: the quorum is defined by
            # this file alone. `format --standalone` with
            # controller.quorum.bootstrap.servers works too (both tested, restart on
            # other ports included) but also stores the controller endpoint at format.
            "controller.quorum.voters": f"1@{HOST}:{self.controller_port}",
            "listeners": f"PLAINTEXT://{HOST}:{self.port},CONTROLLER://{HOST}:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{HOST}:{self.port}",
            "inter.broker.listener.name": "PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.data_dir / "data"),
            "num.partitions": "1",
            # Tests create their topics explicitly; a typo must fail, not auto-create.
            "auto.create.topics.enable": "false",
            # Internal topics default to RF 3: with one broker, groups and idempotent or
            # transactional producers would hang. One partition (default 50) makes the
            # first consumer group and InitProducerId much faster.
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            # Default 3 s wait before the first rebalance of every new group.
            "group.initial.rebalance.delay.ms": "0",
            # Allocated by the log cleaner at startup; 128 MiB by default.
            "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
        }
        if self.secure:
            props.update(self._secure_properties())
        props.update(self.extra_properties)
        return props

    def _secure_properties(self) -> dict[str, str]:
        """SASL_PLAINTEXT + PLAIN on both listeners, StandardAuthorizer, deny by default.

        The controller listener is SASL too, with ``admin`` its only user: the broker
        half of this node registers, heartbeats and forwards admin requests over it, and
        the controller requires CLUSTER_ACTION for those, i.e. a super user. (Leaving it
        PLAINTEXT works only with ``User:ANONYMOUS`` as a super user, which would make
        anyone who reaches the controller port one: admin clients may talk to
        controllers directly, KIP-919.)
        """
        admin_password = self._passwords[ADMIN]
        users = " ".join(f'user_{p}="{pw}"' for p, pw in self._passwords.items())
        login = "org.apache.kafka.common.security.plain.PlainLoginModule required"
        broker_login = f'username="{ADMIN}" password="{admin_password}"'
        return {
            "listeners": f"CLIENT://{HOST}:{self.port},CONTROLLER://{HOST}:{self.controller_port}",
            "advertised.listeners": f"CLIENT://{HOST}:{self.port}",
            "inter.broker.listener.name": "CLIENT",
            "listener.security.protocol.map": f"CLIENT:{SECURITY_PROTOCOL},CONTROLLER:{SECURITY_PROTOCOL}",
            "sasl.enabled.mechanisms": SASL_MECHANISM,
            "sasl.mechanism.inter.broker.protocol": SASL_MECHANISM,
            "sasl.mechanism.controller.protocol": SASL_MECHANISM,
            "listener.name.client.plain.sasl.jaas.config": f"{login} {broker_login} {users};",
            "listener.name.controller.plain.sasl.jaas.config": (
                f'{login} {broker_login} user_{ADMIN}="{admin_password}";'
            ),
            "authorizer.class.name": AUTHORIZER,
            "allow.everyone.if.no.acl.found": "false",
            "super.users": f"User:{ADMIN}",
        }

    def start(self, timeout_s: float = 120) -> Self:
        """Resolve jars, format storage if new, launch the JVM, wait until it serves."""
        if self._proc is not None:
            raise KafkaBrokerError("broker already started")
        libs = resolve_jars(self.cache_dir)
        deadline = time.monotonic() + timeout_s
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "server.properties"
        # 0600: a secure broker's JAAS config holds every password.
        _write_private(config, _to_properties(self.properties()))
        if self.secure:
            self.credentials.save(self.credentials_file)
        java = [_java(), f"-Dlog4j2.configurationFile={LOG4J_CONFIG}", "-cp", f"{libs}/*"]
        meta = self.data_dir / "data" / "meta.properties"
        if not meta.exists():  # else: a restart
            self._format(java, config, timeout_s)
        cluster_id = _read_properties(meta)["cluster.id"]
        # A taken port does not always make Kafka exit, and the readiness check would
        # then talk to whoever holds it; so refuse up front.
        for port in (self.port, self.controller_port):
            _check_free(port)
        # Append, so a restart keeps the earlier log; error tails start at this run.
        self._log_offset = self.log_file.stat().st_size if self.log_file.exists() else 0
        with self.log_file.open("ab") as log:
            # Exit on OOM rather than limp on: the log tail then says what happened.
            jvm = [*self.heap, "-XX:+ExitOnOutOfMemoryError"]
            self._proc = subprocess.Popen(
                [*java, *jvm, "kafka.Kafka", str(config)],
                stdin=subprocess.DEVNULL,
                # Not our stdout: `$(python -m log.local_kafka start)` would hang.
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=self.detach,
            )
        try:
            self._wait_ready(cluster_id, deadline, timeout_s)
        except BaseException:
            self._kill()
            raise
        return self

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM (Kafka then shuts down cleanly, <1 s), SIGKILL after ``timeout_s``."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the broker: a crash. The data directory stays; ``start()`` restarts it on the same ports."""
        self._kill()

    def __enter__(self) -> Self:
        return self if self._proc is not None else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _format(self, java: list[str], config: Path, timeout_s: float) -> None:
        # Kafka's own id format (Uuid.toString): 22 chars of unpadded url-safe base64.
        # Made here to save a JVM start for `StorageTool random-uuid`.
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        # "--cluster-id=ID" in one argument: one id in 64 starts with "-", which a separate
        # argument would be parsed as an option.
        cmd = [*java, "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "-c", str(config)]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as e:
            raise KafkaBrokerError(f"storage format timed out after {timeout_s}s") from e
        if result.returncode != 0:
            raise KafkaBrokerError(f"storage format failed:\n{result.stdout}{result.stderr}")

    def _wait_ready(self, cluster_id: str, deadline: float, timeout_s: float) -> None:
        while self._proc is not None:
            if (rc := self._proc.poll()) is not None:
                msg = f"Kafka broker exited with code {rc}."
                raise KafkaBrokerError(f"{msg}\n{self._log_tail()}")
            # The listener port opens only after metadata catch-up (SocketServer), so
            # it is a cheap first check; a real admin request confirms it serves, and
            # the cluster id that it is this broker.
            if _port_open(self.port) and self._cluster_id() == cluster_id:
                return
            if time.monotonic() > deadline:
                msg = f"Kafka broker not ready after {timeout_s}s."
                raise KafkaBrokerError(f"{msg}\n{self._log_tail()}")
            time.sleep(0.2)

    def _cluster_id(self) -> str | None:
        try:
            admin = KafkaAdminClient(
                **self.client_configs(),
                client_id="local-kafka-readiness",
                bootstrap_timeout_ms=5000,
                request_timeout_ms=5000,
            )
        except (KafkaError, OSError):
            return None
        try:
            cluster = admin.describe_cluster()
        except (KafkaError, OSError):
            return None
        else:
            return str(cluster["cluster_id"]) if cluster["brokers"] else None
        finally:
            admin.close()

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def _log_tail(self) -> str:
        try:
            with self.log_file.open("rb") as f:
                f.seek(self._log_offset)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return f"(no broker log at {self.log_file})"
        tail = "\n".join(lines[-_LOG_TAIL_LINES:])
        return f"Last lines of {self.log_file}:\n{tail}"


def stop_pid(pid: int, timeout_s: float = 30) -> bool:
    """Stop a detached broker by pid; False if no broker with that pid is running."""
    if not _running(pid) or not _is_kafka(pid):  # a stale pid file may name a reused pid
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _running(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.1)
    return True


def _resolve_passwords(credentials_file: Path, given: Mapping[str, str] | None) -> dict[str, str]:
    """Every principal's password: given, else from an earlier start, else new."""
    earlier: dict[str, str] = {}
    if credentials_file.is_file():
        earlier = dict(KafkaCredentials.load(credentials_file).passwords)
    given = dict(given or {})
    passwords: dict[str, str] = {}
    for principal in dict.fromkeys([*PRINCIPALS, *earlier, *given]):
        password = given.get(principal) or earlier.get(principal) or secrets.token_urlsafe(24)
        if not _PRINCIPAL_RE.fullmatch(principal):
            raise ValueError(f"bad principal name {principal!r}")
        if not _PASSWORD_RE.fullmatch(password) or '"' in password or "\\" in password:
            raise ValueError(f"password of {principal!r}: printable ASCII without spaces, quotes or backslashes")
        passwords[principal] = password
    return passwords


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by its owner only (also if it existed with wider modes)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _to_properties(props: Mapping[str, str]) -> str:
    # Java properties: backslash is the escape character; a newline would end the value.
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace("\n", "\\n")

    return "".join(f"{k}={escape(v)}\n" for k, v in props.items())


def _read_properties(path: Path) -> dict[str, str]:
    # Enough for the key=value files Kafka writes (meta.properties).
    lines = path.read_text().splitlines()
    pairs = (ln.split("=", 1) for ln in lines if "=" in ln and not ln.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def _check_free(port: int) -> None:
    """Refuse a port someone listens on, as Kafka's own bind would.

    Kafka (the JVM) binds its listeners with SO_REUSEADDR, so connections of a broker that
    was just killed, still in TIME_WAIT on the port, do not stop it; the probe binds the same
    way, or a restart right after a crash would be refused for a minute.
    """
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError as e:
            raise KafkaBrokerError(f"port {HOST}:{port} is already in use") from e


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    return str(Path(java_home) / "bin" / "java") if java_home else "java"


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000
"""Ports a broker picks for itself are drawn from here up to the ephemeral range."""


def _ephemeral_range() -> tuple[int, int] | None:
    """The kernel's range of local ports for outgoing connections (Linux), None if unknown."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free now, outside the kernel's ephemeral range where it can.

    A broker that is killed and started again (the chaos runs) must get its ports back. One
    in the ephemeral range is free for the kernel to hand out as the local port of any
    outgoing connection while the broker is down, a client of the broker reconnecting to it
    included (a TCP self-connect); the restart is then refused ("port ... in use"), and the
    broker stays down (a chaos run waited out its deadline so). Someone may still bind a
    port picked here before Kafka does, which start() then reports."""
    span = _ephemeral_range()
    if span is None or span[0] - LOWEST_PORT < 1000:
        return _kernel_ports(count)
    rng = random.Random()
    picked: list[int] = []
    for _ in range(200 * count):
        port = rng.randrange(LOWEST_PORT, span[0])
        if port in picked:
            continue
        try:
            _check_free(port)
        except KafkaBrokerError:
            continue
        picked.append(port)
        if len(picked) == count:
            return picked
    return _kernel_ports(count)


_free_ports = free_ports


def _kernel_ports(count: int) -> list[int]:
    # Hold all sockets open together so the ports differ.
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1):
            return True
    except OSError:
        return False


def _running(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    if Path("/proc/self").exists():
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            return False
        # A zombie has exited; it only waits to be reaped by a parent that may never do
        # so (e.g. a container's PID 1), so it counts as stopped.
        return state != "Z"
    try:  # no /proc (macOS)
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _is_kafka(pid: int) -> bool:
    try:
        return b"kafka.Kafka" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return not Path("/proc/self").exists()  # cannot check without /proc: trust the pid


def _read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m log.local_kafka", description="Local single-node Kafka broker.")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start a detached broker; prints KAFKA_BOOTSTRAP_SERVERS=...")
    start.add_argument("--port", type=int, default=0, help="0 = a free port")
    start.add_argument("--controller-port", type=int, default=0, help="0 = a free port")
    start.add_argument("--data-dir", type=Path, help="default: a fresh temp dir (kept)")
    start.add_argument("--pid-file", type=Path, required=True)
    start.add_argument("--timeout", type=float, default=120)
    start.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    start.add_argument(
        "--secure",
        action="store_true",
        help="SASL/PLAIN + ACLs; also prints AGENTLOG_KAFKA_CREDENTIALS=<credentials.json>",
    )
    stop = sub.add_parser("stop", help="stop the broker named by --pid-file and wait for it")
    stop.add_argument("--pid-file", type=Path, required=True)
    stop.add_argument("--timeout", type=float, default=30)
    args = parser.parse_args(argv)

    if args.command == "stop":
        pid = _read_pid(args.pid_file)
        if pid is None or not stop_pid(pid, args.timeout):
            print(f"no running Kafka broker in {args.pid_file}", file=sys.stderr)
        args.pid_file.unlink(missing_ok=True)
        return 0

    if (pid := _read_pid(args.pid_file)) is not None and _running(pid) and _is_kafka(pid):
        print(
            f"Kafka broker already running with pid {pid} ({args.pid_file})",
            file=sys.stderr,
        )
        return 1
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="kafka-"))
    broker = LocalKafkaBroker(
        port=args.port,
        controller_port=args.controller_port,
        data_dir=data_dir,
        cache_dir=args.cache_dir,
        detach=True,
        secure=args.secure,
    )
    try:
        broker.start(args.timeout)
    except KafkaBrokerError as e:
        print(e, file=sys.stderr)
        return 1
    args.pid_file.parent.mkdir(parents=True, exist_ok=True)
    args.pid_file.write_text(f"{broker.pid}\n")
    print(f"broker log: {broker.log_file}", file=sys.stderr)
    print(f"KAFKA_BOOTSTRAP_SERVERS={broker.bootstrap_servers}", flush=True)
    if broker.secure:
        print(f"AGENTLOG_KAFKA_CREDENTIALS={broker.credentials_file}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
