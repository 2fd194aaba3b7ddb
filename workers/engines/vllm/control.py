"""The control channel between the engine bridge and ``AgentlogScheduler`` inside vLLM.

**Transport.** ZeroMQ: the scheduler binds a ROUTER socket (a thread in vLLM's engine-core
process), each client connects a DEALER. One request frame, one reply frame, both msgpack
maps (``msgspec.msgpack``)::

    request: {"op": "hello" | "status" | "pin" | "release" | "discard",
              "session": str, "ttl_s": float, "score": float, "token": str}
    reply:   {"ok": true, ...op's fields} | {"ok": false, "error": str}

Every request gets a reply: a refusal (``ControlError``) and any other exception inside the
scheduler (logged there) are both ``{"ok": false}``, which the client raises as
``ControlError`` and the bridge's actuator as ``ActuationRefused`` (never retried); only
silence (vLLM down) is ``ControlUnavailable``, retried.

**Ops** (all idempotent, so a bridge may re-apply a decision after a crash):

- ``hello`` -> ``epoch`` (one run of the engine; also the suffix of the KV events topic),
  ``block_size``, ``num_gpu_blocks``;
- ``status`` -> ``num_free_blocks``, ``pins`` (session -> blocks, seconds left, score),
  ``pending`` (sessions whose pin waits for their running call to end),
  ``pressure_releases`` (sessions whose pins were released under pressure, in order),
  ``running`` (the sessions of vLLM's running requests), ``waiting`` (``[session,
  priority]`` of its waiting requests, in the order it will admit them) and
  ``kv_batches_unpublished`` (KV event batches queued in vLLM's publisher, not yet sent nor
  in its replay buffer: 0 once a replay would return every batch so far);
- ``pin`` session, ttl_s, score -> ``num_blocks``: hold the session's full blocks for
  ``ttl_s`` seconds of the scheduler's monotonic clock (``inf``: until released; renews an
  existing pin; while the session's call runs, the pin is taken when it ends,
  ``pending: true``; after the call, the blocks still cached are taken back);
- ``release`` session -> ``num_blocks``: drop the pin; the blocks go back to vLLM's LRU
  (tail first), still reusable until evicted;
- ``discard`` session -> ``num_blocks``: drop the pin and evict the session's cached blocks
  that nobody else uses now (vLLM emits ``BlockRemoved``).

**Who may talk to it.** Default endpoint: an ``ipc://`` socket in a private directory. The
server refuses to bind an ipc socket whose directory other users can enter, and refuses a
``tcp://`` endpoint unless a token is configured (``AGENTLOG_VLLM_CONTROL_TOKEN``); with a
token every request must carry it (compared in constant time).

This module is imported by both sides: inside vLLM (``ControlServer``, stdlib + pyzmq +
msgspec only) and in the bridge (``ControlClient``, asyncio).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

__all__ = [
    "CONTROL_ENV",
    "TOKEN_ENV",
    "ControlClient",
    "ControlError",
    "ControlServer",
    "ControlUnavailable",
    "check_endpoint_private",
]

CONTROL_ENV = "AGENTLOG_VLLM_CONTROL"
"""The endpoint the scheduler binds (set by the launcher, read inside vLLM)."""
TOKEN_ENV = "AGENTLOG_VLLM_CONTROL_TOKEN"
# "1": the scheduler ranks pins by their sessions' priorities (``workers.engines.vllm.scheduler``).
RANKED_PINS_ENV = "AGENTLOG_VLLM_RANKED_PINS"

OPS = ("hello", "status", "pin", "release", "discard")

_log = logging.getLogger(__name__)
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(dict).decode


class ControlError(Exception):
    """The scheduler refused a request (unknown op, bad arguments, bad token)."""


class ControlUnavailable(Exception):
    """No answer from the scheduler (vLLM down or restarting): retry later."""


def check_endpoint_private(endpoint: str, token: str | None) -> None:
    """Refuse endpoints that anyone else on the machine (or network) could use without a token."""
    if endpoint.startswith("ipc://"):
        directory = Path(endpoint.removeprefix("ipc://")).parent
        mode = directory.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO) and not token:
            raise PermissionError(
                f"control socket directory {directory} is accessible to other users (mode {oct(mode & 0o777)}); "
                f"chmod 700 it or set {TOKEN_ENV}"
            )
    elif endpoint.startswith("tcp://"):
        if not token:
            raise PermissionError(f"a tcp control endpoint ({endpoint}) needs {TOKEN_ENV}")
    elif not endpoint.startswith("inproc://"):
        raise ValueError(f"control endpoint must be ipc://, tcp:// or inproc://, not {endpoint!r}")


class ControlServer:
    """A ROUTER socket served by a daemon thread.

    ``handle(request) -> reply fields`` runs on the thread for each request (it raises
    ``ControlError`` for a refusal; any other exception is logged and answered as a refusal
    too, so every request gets a reply); ``tick()`` runs after each request and at least every
    ``tick_s`` (the scheduler expires pins there even while vLLM is idle).
    """

    def __init__(
        self,
        endpoint: str,
        handle: Callable[[dict[str, Any]], dict[str, Any]],
        tick: Callable[[], None],
        *,
        token: str | None = None,
        tick_s: float = 0.1,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        check_endpoint_private(endpoint, token)
        self.endpoint = endpoint
        self._handle = handle
        self._tick = tick
        self._token = token
        self._tick_ms = int(tick_s * 1000)
        self._ctx = context or zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        if endpoint.startswith("ipc://"):
            os.chmod(endpoint.removeprefix("ipc://"), 0o600)
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="agentlog-control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while self._running:
            try:
                if self._socket.poll(self._tick_ms):
                    frames = self._socket.recv_multipart()
                    self._socket.send_multipart([*frames[:-1], _encode(self._answer(frames[-1]))])
                self._tick()
            except zmq.ZMQError:
                if not self._running:
                    return
                _log.exception("control channel socket error")
            except Exception:  # the engine must outlive a bad request or a failed tick
                _log.exception("control channel error")

    def _answer(self, payload: bytes) -> dict[str, Any]:
        try:
            request = _decode(payload)
        except msgspec.DecodeError as e:
            return {"ok": False, "error": f"not a msgpack map: {e}"}
        if self._token is not None and not hmac.compare_digest(
            str(request.get("token", "")).encode(), self._token.encode()
        ):
            return {"ok": False, "error": "bad or missing token"}
        if request.get("op") not in OPS:
            return {"ok": False, "error": f"unknown op {request.get('op')!r}; ops are {', '.join(OPS)}"}
        try:
            return {"ok": True, **self._handle(request)}
        except ControlError as e:
            return {"ok": False, "error": str(e)}
        except Exception as e:  # a bug in a handler: answer anyway, a silent server makes clients retry forever
            _log.exception("control op %r failed", request.get("op"))
            return {"ok": False, "error": f"{request.get('op')} failed inside the scheduler: {type(e).__name__}: {e}"}

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=2)
        self._socket.close(linger=0)


class ControlClient:
    """The bridge's side: one request at a time, with a timeout; reconnects after a timeout
    (the scheduler may have restarted with vLLM)."""

    def __init__(self, endpoint: str, *, token: str | None = None, timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint
        self._token = token if token is not None else os.environ.get(TOKEN_ENV)
        self._timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.asyncio.Context.instance()
        self._socket: zmq.asyncio.Socket | None = None
        self._lock = asyncio.Lock()  # one request in flight: replies carry no request id

    def _connect(self) -> zmq.asyncio.Socket:
        if self._socket is None:
            self._socket = self._ctx.socket(zmq.DEALER)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.connect(self.endpoint)
        return self._socket

    def _reset(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        request: dict[str, Any] = {"op": op, **{k: v for k, v in fields.items() if v is not None}}
        if self._token:
            request["token"] = self._token
        async with self._lock:
            socket = self._connect()
            await socket.send_multipart([b"", _encode(request)])
            if not await socket.poll(self._timeout_ms):
                self._reset()  # a late reply must not answer the next request
                raise ControlUnavailable(f"no answer from the vLLM scheduler at {self.endpoint} for {op}")
            frames = await socket.recv_multipart()
        reply = _decode(frames[-1])
        if not reply.get("ok"):
            raise ControlError(f"vLLM scheduler refused {op}: {reply.get('error')}")
        return reply

    async def aclose(self) -> None:
        self._reset()
