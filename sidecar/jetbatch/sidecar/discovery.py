"""Discovery through the NATS micro-services protocol: ``nats micro ls``, ``info`` and ``stats``
list every sidecar with its models, residency and counters.

Each sidecar answers ``$SRV.PING``, ``$SRV.INFO`` and ``$SRV.STATS`` (for all services, for its
service name ``jetbatch-worker`` or ``jetbatch-classifier``, and for its own id) with the
protocol's documents, built with nats-py's ``nats.micro`` data classes. Its one endpoint is the
status subject ``<prefix>.status`` that ``jetbatch status`` asks, so both read the same thing:
STATS carries the sidecar's report (:class:`SidecarReport`) as the endpoint's ``data``.

Why not ``nats.micro.add_service``: its control handlers answer whatever reply subject a request
names, so anyone allowed to publish ``$SRV.PING`` could aim a sidecar's answer at
``$JS.API.STREAM.DELETE.…`` with the sidecar's permissions. Here every answer goes through the
deployment's reply allowlist, as request answers do.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import datetime, timezone
from typing import Any, Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.micro.service import EndpointInfo, EndpointStats, ServiceInfo, ServicePing, ServiceStats, ServiceVerb, control_subject

from jetbatch.sdk.protocol import ProtocolError, ReplyPolicy, SidecarReport, Subjects

__all__ = ["MicroService", "service_name"]

log = logging.getLogger("jetbatch.discovery")


def service_name(role: str) -> str:
    """The micro service name of a sidecar ``role`` (``worker``, ``classifier``)."""
    return f"jetbatch-{role}"


def _service_id(sidecar_id: str) -> str:
    # Micro ids and names are tokens of [A-Za-z0-9_-]; a worker id may hold dots or colons.
    return re.sub(r"[^A-Za-z0-9_-]", "-", sidecar_id) or "sidecar"


class MicroService:
    """The micro-services face of one sidecar; :meth:`start` subscribes, :meth:`stop` leaves."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        role: str,
        report: Callable[[], SidecarReport],
        policy: ReplyPolicy,
        version: str,
        *,
        out: NATS | None = None,
    ) -> None:
        self.nc = nc
        self.out = out or nc  # answers go out on the reply identity's connection when there is one
        self.subjects = subjects
        self.role = role
        self.report = report
        self.policy = policy
        self.version = version
        self.name = service_name(role)
        self.subs: list[Any] = []
        self.started = datetime.now(timezone.utc)
        self.status_requests = 0
        self.status_seconds = 0.0
        first = report()
        self.id = _service_id(first.id)
        self.metadata = {"prefix": subjects.prefix, "role": role, "sidecar_id": first.id}

    async def start(self) -> None:
        handlers = {ServiceVerb.PING: self._ping, ServiceVerb.INFO: self._info, ServiceVerb.STATS: self._stats}
        for verb, handler in handlers.items():
            for name, sid in ((None, None), (self.name, None), (self.name, self.id)):
                self.subs.append(await self.nc.subscribe(control_subject(verb, name=name, id=sid), cb=handler))

    async def stop(self) -> None:
        for sub in self.subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - the connection may already be gone
                pass
        self.subs.clear()

    def note_status_request(self, seconds: float) -> None:
        """Count a request answered on the status endpoint (STATS)."""
        self.status_requests += 1
        self.status_seconds += seconds

    # --- the control subjects ------------------------------------------------------------------

    async def _answer(self, msg: Msg, body: dict[str, Any]) -> None:
        if not msg.reply:
            return
        try:
            self.policy.check(msg.reply)
        except ProtocolError:
            return  # not an inbox: nobody legitimate waits there
        try:
            await self.out.publish(msg.reply, json.dumps(body, default=str).encode())
        except Exception as exc:  # noqa: BLE001 - discovery must never end the sidecar
            log.debug("discovery answer failed: %s", exc)

    def _metadata(self) -> dict[str, str]:
        r = self.report()
        return {**self.metadata, "models": ",".join(sorted(r.models)), "resident": ",".join(sorted(r.resident))}

    async def _ping(self, msg: Msg) -> None:
        await self._answer(msg, ServicePing(id=self.id, name=self.name, version=self.version, metadata=self._metadata()).to_dict())

    def _endpoint(self) -> EndpointInfo:
        return EndpointInfo(name="status", subject=self.subjects.status_subject, queue_group="", metadata={"format": "SidecarReport JSON"})

    async def _info(self, msg: Msg) -> None:
        info = ServiceInfo(
            name=self.name,
            id=self.id,
            version=self.version,
            description=f"jetbatch {self.role} sidecar (prefix {self.subjects.prefix})",
            endpoints=[self._endpoint()],
            metadata=self._metadata(),
        )
        await self._answer(msg, info.to_dict())

    async def _stats(self, msg: Msg) -> None:
        n = self.status_requests
        avg_ns = int(self.status_seconds / n * 1e9) if n else 0
        endpoint = EndpointStats(
            name="status",
            subject=self.subjects.status_subject,
            queue_group="",
            num_requests=n,
            num_errors=0,
            processing_time=int(self.status_seconds * 1e9),
            average_processing_time=avg_ns,
            data=msgspec.to_builtins(self.report()),
        )
        stats = ServiceStats(id=self.id, name=self.name, version=self.version, started=self.started, endpoints=[endpoint], metadata=self._metadata())
        await self._answer(msg, stats.to_dict())
