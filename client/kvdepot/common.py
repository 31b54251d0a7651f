"""What DepotClient (threads) and AsyncDepotClient (asyncio) share: the settings, the registration
and its keeper's decisions, request building, and the rule that turns an engine-path failure into
a miss. The two clients differ only in how they wait.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import grpc

from kvdepot import messages as m
from kvdepot.errors import from_rpc_error
from kvdepot.layout import KvLayout
from kvdepot.v1 import kvdepot_pb2 as pb
from kvdepot.v1 import kvdepot_pb2_grpc as pb_grpc

log = logging.getLogger("kvdepot")
DEFAULT_ADDRESS = "127.0.0.1:50061"
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.enable_retries", 0),
]
REJECTION_LOG_S = 30
# After QUIET_AFTER engine-path calls in a row the daemon did not answer within their deadline (a
# frozen or overloaded daemon, a black-holed network), engine-path calls answer a miss at once for
# QUIET_S, then one call tries again: a daemon that stays silent costs the engine one deadline a
# second, not one a step. One late answer alone (a busy machine) costs one miss, as before.
QUIET_AFTER = 2
QUIET_S = 1.0


class Every:
    """True for a key at most once per period: log lines that would otherwise repeat every step."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._last: dict[object, float] = {}

    def due(self, key: object) -> bool:
        now = time.monotonic()
        if now - self._last.get(key, -self.period_s) < self.period_s:
            return False
        self._last[key] = now
        return True


MISSES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class Registration:
    """What the client registered, so it can register again after the daemon forgot it."""

    def __init__(self, req: pb.RegisterEngineRequest) -> None:
        self.req = req
        self.engine_id = ""
        self.lease_ms = 30_000
        self.epoch = 0  # bumps each time the daemon gives a new engine id: older slots are gone
        self.block_bytes = 0

    def accept(self, r: pb.RegisterEngineResponse) -> None:
        self.engine_id = r.engine_id
        self.lease_ms = r.lease_ms or self.lease_ms
        self.block_bytes = r.block_bytes
        self.epoch += 1


def degraded(client: Any, e: grpc.RpcError, what: str) -> None:
    """Decides whether an engine-path failure is a miss (logged, returned) or raised (strict)."""
    code = e.code()
    if client.strict:
        raise from_rpc_error(e, client.address) from None
    if code is grpc.StatusCode.NOT_FOUND and client._reg is not None and "is not registered" in (e.details() or ""):
        client._reg.engine_id = ""  # the daemon restarted or our lease expired: the keeper re-registers
    client._late = client._late + 1 if code is grpc.StatusCode.DEADLINE_EXCEEDED else 0
    if client._late >= QUIET_AFTER:
        client._quiet_until = time.monotonic() + QUIET_S
        if client._rejections.due("quiet"):
            log.warning(
                "kvdepot: the daemon at %s did not answer %d engine calls in a row (the last a %s) within %.0f ms; engine calls are "
                "misses for %.0f s at a time until it answers (said at most every %d s)",
                client.address, client._late, what, client.deadline_s * 1000, QUIET_S, REJECTION_LOG_S,
            )
    if code in MISSES or code is grpc.StatusCode.NOT_FOUND:
        log.debug("kvdepot %s degraded to a miss: %s", what, code.name)
    elif client._rejections.due((what, code)):  # e.g. a revoked token: every call of every step
        log.error("kvdepot %s rejected (%s): %s; treating it as a miss (said at most every %d s)", what, code.name, e.details(), REJECTION_LOG_S)


class ClientCore:
    """What the sync and asyncio clients share: settings, registration state, request building
    and the decisions about failures. Subclasses only differ in how they wait."""

    def __init__(self, address: str, deadline_s: float, admin_deadline_s: float, strict: bool, channel: Any, token: str = "") -> None:
        self.address = address
        self._token = token  # for the handoff socket, which carries no metadata
        self.deadline_s = deadline_s
        self.admin_deadline_s = admin_deadline_s
        self.strict = strict
        self._channel = channel
        self._stub = pb_grpc.BlockManagerStub(channel)
        self._reg: Registration | None = None
        self._step = 0
        self._rejections = Every(REJECTION_LOG_S)
        self._next_beat = 0.0
        self._quiet_until = 0.0  # engine-path calls are misses until then (QUIET_S)
        self._late = 0  # engine-path calls in a row the daemon did not answer in time

    def _quiet(self) -> bool:
        """The daemon did not answer an engine-path call in time a moment ago: answer a miss at once."""
        return time.monotonic() < self._quiet_until

    @property
    def engine_id(self) -> str:
        return self._reg.engine_id if self._reg else ""

    @property
    def epoch(self) -> int:
        """Registration generation: when it changes, the daemon has no slots of older requests."""
        return self._reg.epoch if self._reg else 0

    @property
    def last_step(self) -> int:
        return self._step

    def _start_registration(
        self, model: str, layout: KvLayout, name: str, namespace: str, update_style: str, lease_ms: int, key: str, late_load_checks: bool,
        join: bool = False, engine_copies: bool = False,
    ) -> None:
        layout.validate()
        if join and not key:
            raise ValueError("a join names the engine's key")
        self._reg = Registration(m.register_pb(model, layout, name, namespace, update_style, lease_ms, key, late_load_checks, join, engine_copies))

    def _registration_failed(self, e: grpc.RpcError, raise_errors: bool, keep_trying: bool = True) -> bool:
        """False when the daemon did not answer, or a join found no engine yet, and the keeper
        retries (said once, naming the address, when it is the first try); raises a rejection when
        asked, and an unanswered first try unless `keep_trying`."""
        if e.code() in MISSES and keep_trying and not (raise_errors and self.strict):
            if raise_errors:
                log.warning(
                    "kvdepot: kvdepotd at %s did not answer (%s); going on without the cache, registering in the background",
                    self.address, e.code().name,
                )
            return False
        if e.code() is grpc.StatusCode.NOT_FOUND and keep_trying and self._reg is not None and self._reg.req.join:
            # Its creator has not registered the engine (again, after a daemon restart) yet: the keeper tries again.
            log.debug("kvdepot: the engine to join is not registered (yet): %s", e.details())
            return False
        if raise_errors:
            raise from_rpc_error(e, self.address) from None
        log.error("kvdepot: registration rejected: %s", e.details())
        return False

    def _heartbeat_failed(self, e: grpc.RpcError) -> None:
        if e.code() is grpc.StatusCode.NOT_FOUND and self._reg is not None:
            log.warning("kvdepot: the daemon forgot engine %s; registering again", self._reg.engine_id)
            self._reg.engine_id = ""
        elif e.code() not in MISSES and self._rejections.due(("heartbeat", e.code())):
            log.error("kvdepot: heartbeat rejected (%s): %s", e.code().name, e.details())

    def _keeper_due(self) -> str | pb.HeartbeatRequest | None:
        """What the keeper (a thread or a task, polling) should do now: "register" when the daemon
        does not know the engine, every third of the lease the heartbeat to send (for the engine id
        read here: an unregister() on another thread may clear the registration meanwhile), else None."""
        reg = self._reg
        if reg is None:
            return None
        now = time.monotonic()
        if reg.engine_id and now < self._next_beat:
            return None
        self._next_beat = now + reg.lease_ms / 3000
        return pb.HeartbeatRequest(engine_id=reg.engine_id) if reg.engine_id else "register"

    def _lookup_request(
        self, request_id: str, tokens: Sequence[int], L: int, cache_salt: str, lora_name: str, pin_ms: int
    ) -> pb.LookupRequest | None:
        if not self.engine_id:
            return None
        return m.lookup_pb(self.engine_id, request_id, tokens, L, cache_salt, lora_name, pin_ms)

    def _step_request(self, batch: m.StepBatch) -> pb.StepRequest | m.StepResult:
        """The next step's request, or its result when no round trip is needed: an empty step needs
        no answer, and an unregistered engine gets a miss (the number is used up either way, so
        forward-done reports stay in step with the engine)."""
        self._step += 1
        if batch.empty or not self.engine_id:
            return m.StepResult(self._step, degraded=not self.engine_id)
        return batch.to_pb(self.engine_id, self._step)

    def _unregister_request(self) -> pb.UnregisterEngineRequest | None:
        if self._reg is None or not self._reg.engine_id:
            return None
        eid, self._reg = self._reg.engine_id, None
        return pb.UnregisterEngineRequest(engine_id=eid)
