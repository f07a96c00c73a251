"""The GPU worker: an I/O loop around the scheduler.

Each turn it refreshes what it knows of the per-model queues (bounded JetStream polling), asks the
scheduler for a decision (serve, load/evict, idle), and carries it out: it pulls a batch from the
chosen model's durable consumer until ``max_batch_size`` or ``max_delay_ms``, runs the handler in a
worker thread, publishes every reply, and only then acks each message.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import random
import re
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import anyio
import anyio.abc
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from sdk.protocol import (
    ContentType,
    ErrorCode,
    Headers,
    ProtocolError,
    Status,
    Subjects,
    deadline_from_headers,
    encode_error,
)

from . import scheduler as sched
from .cluster import ClusterView, WorkerAdvert, effective_backlog
from .deadletter import dead_letter
from .config import Config, ConfigError, ModelConfig
from .handlers import BadInput, Handler, HandlerError, create_handler, resolve_device
from .streams import ensure_model_consumer, ensure_streams, model_consumer_name
from .status import StatusReport, serve_status
from .telemetry import LoadRecord, WorkerTelemetry

__all__ = ["BatchReport", "Worker"]

log = logging.getLogger("jetbatch.worker")

_REPLY_SUBJECT_RE = re.compile(r"^[^\s*>]+$")


@dataclass(frozen=True)
class BatchReport:
    """What one batch did; passed to ``on_batch`` observers (the demo prints one line each)."""

    batch_id: str
    model: str
    size: int
    ok: int
    errors: int
    queue_wait_ms: tuple[float, ...]
    loaded: bool
    compute_s: float
    decision: str


@dataclass(frozen=True)
class LoadReport:
    model: str
    seconds: float
    evicted: tuple[str, ...]
    memory_bytes: int


@dataclass(eq=False)
class _Request:
    msg: Msg
    request_id: str
    reply_to: str | None
    content_type: str | None
    deadline: float | None
    enqueued_at: float  # wall clock, from the JetStream timestamp
    deliveries: int
    value: Any = None
    error: tuple[ErrorCode, str] | None = None
    exception: BaseException | None = None  # what the handler raised, for the batch span


@dataclass
class _Slot:
    """One model this worker serves."""

    name: str
    config: ModelConfig
    handler: Handler
    psub: Any = None
    resident: bool = False
    fresh_load: bool = False  # the next batch is the first after a load: it "paid" the load
    backlog: int = 0
    oldest_enqueued_at: float | None = None
    in_flight: int = 0
    limiter: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(1))
    weights_read: bool = False
    last_used_at: float | None = None
    pending_load: LoadRecord | None = None  # reported under the first batch after the load


class Worker:
    """Serves the models of ``config`` from their JetStream queues on one device.

    Run it with ``await worker.run()`` inside an anyio/asyncio program; ``worker.stop()`` asks for
    a graceful stop (stop fetching, finish in-flight batches, nak what cannot finish, unload).
    """

    def __init__(
        self,
        config: Config,
        nc: NATS,
        *,
        on_batch: Callable[[BatchReport], None] | None = None,
        on_load: Callable[[LoadReport], None] | None = None,
    ) -> None:
        if not config.models:
            raise HandlerError("the worker config has no [models.<name>] section: nothing to serve")
        self.config = config
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects: Subjects = config.subjects
        self.worker_id = config.worker.id or f"{socket.gethostname()}-{os.getpid()}"
        self.device = resolve_device(config.worker.device)
        try:
            self.policy: sched.Policy = sched.make_policy(config.worker.policy, **config.worker.policy_options)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"worker.policy: {exc}") from None
        self.costs = _Costs()
        self.slots: dict[str, _Slot] = {}
        for name, mcfg in config.models.items():
            handler = create_handler(name, mcfg)
            handler.target_device = self.device
            self.slots[name] = _Slot(
                name=name,
                config=mcfg,
                handler=handler,
                limiter=anyio.CapacityLimiter(mcfg.max_concurrent_batches),
            )
            self.costs.seed(
                name,
                load_cost_s=mcfg.load_cost_s,
                batch_cost=sched.BatchCost(mcfg.batch_cost_s, mcfg.item_cost_s),
                memory_bytes=mcfg.memory_bytes or 0,
            )
        self.budget = sched.Budget(
            max_bytes=config.worker.memory_budget_bytes, max_models=config.worker.max_resident_models
        )
        self.telemetry = WorkerTelemetry(self.worker_id, self.subjects.prefix)
        self.telemetry.register_gauges(self.status_report)
        self.on_batch = on_batch
        self.on_load = on_load
        self._stopping = anyio.Event()
        self._ready = anyio.Event()
        self._current: str | None = None
        self._last_refresh = -math.inf
        self._in_flight_msgs: dict[int, Msg] = {}
        self._device_lock = anyio.Lock()  # loads and batches never overlap on the device
        self._prefetching: set[str] = set()
        self._loading: str | None = None
        self.cluster: ClusterView | None = None
        if config.worker.coordinate:
            self.cluster = ClusterView(
                self.js, self.subjects, self.worker_id,
                heartbeat_s=config.worker.heartbeat_s, replicas=config.streams.replicas,
            )  # fmt: skip
        self.stats = {"batches": 0, "requests": 0, "loads": 0, "evictions": 0}
        self._started_at = time.time()

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def ready(self) -> anyio.Event:
        """Set once streams and consumers exist and the worker is pulling."""
        return self._ready

    def stop(self) -> None:
        """Ask for a graceful stop; :meth:`run` returns once in-flight work is drained."""
        self._stopping.set()

    async def run(self) -> None:
        """Set up streams and consumers, then serve until :meth:`stop` (or cancellation)."""
        await ensure_streams(self.js, self.subjects, self.config.streams, self.slots)
        for name, slot in self.slots.items():
            await ensure_model_consumer(self.js, self.subjects, self.config.streams, name)
            slot.psub = await self.js.pull_subscribe_bind(
                durable=model_consumer_name(name), stream=self.subjects.models_stream
            )
        if self.cluster is not None:
            await self.cluster.start()
            await self.cluster.advertise(self.advert())
        status_sub = await serve_status(self.nc, self.subjects, self.status_report)
        log.info("worker %s serving %s on %s", self.worker_id, ", ".join(self.slots), self.device)
        self._ready.set()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeat_loop)
                if self.cluster is not None:
                    tg.start_soon(self._advertise_loop)
                    tg.start_soon(self.cluster.watch)
                try:
                    await self._serve_loop(tg)
                finally:
                    # Let in-flight batches finish within the drain bound, then stop the heartbeat.
                    with anyio.move_on_after(self.config.worker.drain_timeout_s) as scope:
                        scope.shield = True
                        await self._wait_idle()
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await status_sub.unsubscribe()
                except (nats.errors.Error, ValueError):
                    pass
                if self.cluster is not None:
                    await self.cluster.withdraw()
                    await self.cluster.stop()
                await self._nak_leftovers()
                await self._unload_all()
                for slot in self.slots.values():
                    if slot.psub is not None:
                        try:
                            await slot.psub.unsubscribe()
                        except (nats.errors.Error, ValueError):
                            pass

    def status_report(self) -> StatusReport:
        return StatusReport(
            role="worker",
            id=self.worker_id,
            models=list(self.slots),
            resident=[s.name for s in self.slots.values() if s.resident],
            loading=self._loading,
            backlog={s.name: s.backlog for s in self.slots.values()},
            memory_bytes=sum(self.costs.memory_bytes(s.name) for s in self.slots.values() if s.resident),
            memory_budget_bytes=self.budget.max_bytes,
            stats=dict(self.stats),
            started_at=self._started_at,
        )

    async def _wait_idle(self) -> None:
        while any(s.in_flight for s in self.slots.values()):
            await anyio.sleep(0.01)

    async def _nak_leftovers(self) -> None:
        for msg in list(self._in_flight_msgs.values()):
            try:
                await msg.nak()
            except (nats.errors.Error, Exception):  # noqa: BLE001 - best effort on shutdown
                pass
        self._in_flight_msgs.clear()

    async def _unload_all(self) -> None:
        for slot in self.slots.values():
            if slot.resident:
                await self._unload(slot)

    # --- the loop --------------------------------------------------------------------------

    async def _serve_loop(self, tg: anyio.abc.TaskGroup) -> None:
        poll_s = self.config.worker.poll_interval_ms / 1000.0
        while not self._stopping.is_set():
            now = time.time()
            busy = any(s.backlog > 0 for s in self.slots.values())
            # Bounded polling: a few stream-info calls per second when idle, more while busy.
            if now - self._last_refresh >= (poll_s / 5 if busy else poll_s):
                await self._refresh_backlog(now)
            decision = self.policy.decide(self._state(), now)
            if isinstance(decision, sched.Serve):
                slot = self.slots[decision.model]
                if not slot.resident:
                    log.warning("policy %s chose non-resident model %s; loading it", self.policy.name, slot.name)
                    await self._load(slot, (), reason="serve-non-resident")
                    continue
                self._maybe_prefetch(tg, exclude=slot.name)
                await self._serve(tg, slot, decision)
            elif isinstance(decision, sched.Load):
                await self._load(self.slots[decision.model], decision.evict, reason=decision.reason)
            else:
                arrived = await self._idle(decision.until, poll_s)
                if arrived is not None:
                    slot, first = arrived
                    await self._serve(tg, slot, sched.Serve(slot.name, slot.config.max_batch_size, "arrival"), first)

    async def _idle(self, until: float, poll_s: float) -> tuple[_Slot, list[Msg]] | None:
        """Wait for work, never longer than the poll interval. Long-polls the most recently used
        resident model's queue, so a request for it starts a batch at once; other models are seen
        at the next backlog refresh."""
        wait_s = max(0.0, min(until - time.time(), poll_s))
        resident = [s for s in self.slots.values() if s.resident]
        with anyio.move_on_after(wait_s):
            if resident and wait_s > 0.002:
                slot = max(resident, key=lambda s: s.last_used_at or 0)
                msgs = await self._fetch(slot, 1, wait_s)
                if msgs:
                    return slot, msgs
            await self._stopping.wait()
        return None

    async def _fetch(self, slot: _Slot, n: int, timeout_s: float) -> list[Msg]:
        if timeout_s < 0.001 or n <= 0:
            return []
        try:
            return await slot.psub.fetch(batch=n, timeout=timeout_s)
        except (nats.errors.TimeoutError, TimeoutError):
            return []
        except nats.errors.ConnectionClosedError:
            self._stopping.set()
            return []
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            # Typically a reconnect in progress: back off so the loop does not spin meanwhile.
            log.warning("fetch for %s failed: %r", slot.name, exc)
            await anyio.sleep(0.1)
            return []

    async def _gather_before(self, slot: _Slot, max_items: int, before: float) -> list[Msg]:
        """Arrival-order batching: pull one at a time while requests are older than ``before``;
        the first newer one goes back to the queue (nak) for a later batch."""
        msgs: list[Msg] = []
        while len(msgs) < max_items:
            got = await self._fetch(slot, 1, 0.05)
            if not got:
                break
            if _enqueued_at(got[0], time.time()) >= before and msgs:
                await got[0].nak()
                break
            msgs.extend(got)
        return msgs

    async def _gather(self, slot: _Slot, max_items: int, first: list[Msg] | None = None) -> list[Msg]:
        """Pull until ``max_items`` or until ``max_delay_ms`` after the first request of the batch
        was enqueued (a request that already waited that long does not wait again)."""
        max_delay_s = slot.config.max_delay_ms / 1000.0
        msgs: list[Msg] = list(first or [])
        window_end: float | None = None
        if msgs:
            window_end = min(time.time(), _enqueued_at(msgs[0], time.time())) + max_delay_s
        first_wait_s = min(self.config.worker.poll_interval_ms / 1000.0, 0.5)

        def device_busy() -> bool:
            # The batch gathered now cannot start before a running one ends: keep filling it
            # meanwhile instead of closing it at the window and running it small.
            return slot.in_flight >= slot.config.max_concurrent_batches

        while len(msgs) < max_items and not self._stopping.is_set():
            now = time.time()
            remaining = (window_end - now) if window_end is not None else first_wait_s
            if msgs and device_busy():
                remaining = max(remaining, 0.005)
            if remaining <= 0.0005 and msgs:
                break
            got = await self._fetch(slot, max_items - len(msgs), max(remaining, 0.001))
            if not got:
                if msgs and device_busy():
                    continue
                if window_end is None or time.time() >= window_end:
                    break
                continue
            if window_end is None:
                first_enqueued = _enqueued_at(got[0], time.time())
                window_end = min(time.time(), first_enqueued) + max_delay_s
            msgs.extend(got)
            slot.backlog = _pending_after(got[-1], slot.backlog - len(got))
        return msgs

    async def _serve(
        self, tg: anyio.abc.TaskGroup, slot: _Slot, decision: sched.Serve, first: list[Msg] | None = None
    ) -> None:
        # Pipelining: gather the next batch while the previous one computes, but never hold more
        # than one gathered batch beyond the ones the model may run at once.
        if slot.in_flight > slot.config.max_concurrent_batches:
            await self._wait_for(lambda: slot.in_flight <= slot.config.max_concurrent_batches)
        max_items = max(1, min(decision.max_items, slot.config.max_batch_size))
        if decision.before is not None and not first:
            msgs = await self._gather_before(slot, max_items, decision.before)
        else:
            msgs = await self._gather(slot, max_items, first)
        if not msgs:
            slot.backlog = 0
            slot.oldest_enqueued_at = None
            return
        for m in msgs:
            self._in_flight_msgs[id(m)] = m
        slot.in_flight += 1
        loaded = slot.fresh_load
        slot.fresh_load = False
        tg.start_soon(self._run_batch, slot, msgs, loaded, decision.reason)

    async def _wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await anyio.sleep(0.005)

    # --- batches ---------------------------------------------------------------------------

    def _parse(self, msg: Msg, now: float) -> _Request:
        headers = msg.headers or {}
        rid = headers.get(Headers.MSG_ID) or uuid.uuid4().hex
        reply_to = headers.get(Headers.REPLY_TO)
        meta_deliveries = 1
        try:
            meta_deliveries = msg.metadata.num_delivered
        except Exception:  # noqa: BLE001 - not a JetStream message (cannot happen on a pull consumer)
            pass
        req = _Request(
            msg=msg,
            request_id=rid,
            reply_to=reply_to if reply_to and _REPLY_SUBJECT_RE.match(reply_to) else None,
            content_type=headers.get(Headers.CONTENT_TYPE),
            deadline=None,
            enqueued_at=_enqueued_at(msg, now),
            deliveries=meta_deliveries,
        )
        if reply_to and req.reply_to is None:
            req.error = (ErrorCode.BAD_REQUEST, f"header {Headers.REPLY_TO}: {reply_to!r} is not a valid NATS subject")
        try:
            req.deadline = deadline_from_headers(headers)
        except ProtocolError as exc:
            req.error = (ErrorCode.BAD_REQUEST, str(exc))
        return req

    async def _run_batch(self, slot: _Slot, msgs: list[Msg], loaded: bool, reason: str) -> None:
        batch_id = uuid.uuid4().hex[:16]
        now = time.time()
        requests = [self._parse(m, now) for m in msgs]
        try:
            async with slot.limiter:
                async with self._device_lock:
                    await self._compute(slot, batch_id, requests, loaded, reason)
        finally:
            for m in msgs:
                self._in_flight_msgs.pop(id(m), None)
            slot.in_flight -= 1

    async def _compute(self, slot: _Slot, batch_id: str, requests: list[_Request], loaded: bool, reason: str) -> None:
        now = time.time()
        waits_ms = [max(0.0, (now - r.enqueued_at) * 1000.0) for r in requests]
        max_deliver = self.config.streams.max_deliver
        for r in requests:
            if r.error is not None:
                continue
            if r.deadline is not None and r.deadline < now:
                r.error = (ErrorCode.DEADLINE_EXCEEDED, f"deadline passed {now - r.deadline:.3f}s before compute")
            else:
                try:
                    r.value = slot.handler.decode(r.msg.data, r.content_type)
                except BadInput as exc:
                    r.error = (ErrorCode.BAD_REQUEST, str(exc))
                except Exception as exc:  # noqa: BLE001 - a custom decode must not take the batch down
                    r.error = (ErrorCode.BAD_REQUEST, f"cannot decode payload: {exc}")
        good = [r for r in requests if r.error is None]
        load_record = slot.pending_load if loaded else None
        slot.pending_load = None
        with self.telemetry.batch_span(
            slot.name,
            [r.msg.headers for r in requests],
            batch_id=batch_id,
            waits_ms=waits_ms,
            decision=reason,
            loaded=loaded,
            start_ns=load_record.start_ns if load_record else None,
        ) as span:
            if load_record is not None:
                self.telemetry.record_load(load_record, span)
            started = time.perf_counter()
            outputs: dict[int, Any] = {}
            trace_id = self.telemetry.trace_id_hex(span)
            # Redelivered requests may be what crashed an earlier worker: first serve, answer and
            # ack the first-time requests as one batch, then the suspects one at a time, so a
            # poison request can only take itself down. Stream order is stable across
            # redeliveries: a request that kills the worker stays ahead of the innocents that
            # shared its fetch, so the first suspect on its last delivery is the one that was
            # running at each crash. It gets model_failed (and a dead letter) without another
            # attempt; the suspects after it are computed.
            fresh = [r for r in good if r.deliveries <= 1]
            suspects = sorted((r for r in good if r.deliveries > 1), key=_stream_seq)
            if suspects and max_deliver > 1 and suspects[0].deliveries >= max_deliver:
                culprit = suspects.pop(0)
                culprit.error = (ErrorCode.MODEL_FAILED, f"request was delivered {culprit.deliveries} times without completing")
            suspect_ids = {id(r) for r in suspects}
            position = {id(r): i for i, r in enumerate(requests)}
            first_part = [r for r in requests if id(r) not in suspect_ids]
            if fresh:
                with self.telemetry.child_span("infer", **{"jetbatch.model": slot.name, "jetbatch.batch.size": len(fresh)}):
                    await self._predict_isolating(slot, fresh, outputs)
            compute_s = time.perf_counter() - started
            if fresh:
                self.costs.observe_batch(slot.name, len(fresh), compute_s)
                self.telemetry.infer_duration.record(compute_s, {"jetbatch.model": slot.name})
            errors = 0
            if first_part:
                errors += await self._reply_and_ack(
                    slot, batch_id, first_part, outputs, [waits_ms[position[id(r)]] for r in first_part], loaded, trace_id,
                    batch_size=len(requests),
                )  # fmt: skip
            for r in suspects:
                with self.telemetry.child_span("infer", **{"jetbatch.model": slot.name, "jetbatch.batch.size": 1, "jetbatch.redelivered": True}):
                    await self._predict_isolating(slot, [r], outputs)
                errors += await self._reply_and_ack(
                    slot, batch_id, [r], outputs, [waits_ms[position[id(r)]]], loaded, trace_id, batch_size=len(requests)
                )
            if errors:
                span.set_attribute("jetbatch.batch.errors", errors)
                for r in requests:
                    if r.error is not None:
                        span.add_event("request.error", {"jetbatch.request.id": r.request_id, "jetbatch.error.code": r.error[0].value})
                    if r.exception is not None:
                        span.record_exception(r.exception, {"jetbatch.request.id": r.request_id})
                failed = [r for r in requests if r.error and r.error[0] in (ErrorCode.MODEL_FAILED, ErrorCode.INTERNAL)]
                if failed or errors == len(requests):
                    span.set_status(_error_status(f"{errors} of {len(requests)} requests failed"))
        slot.last_used_at = time.time()
        self.policy.on_batch_done(slot.name, len(requests), time.time())
        self.stats["batches"] += 1
        self.stats["requests"] += len(requests)
        if self.on_batch is not None:
            self.on_batch(
                BatchReport(
                    batch_id=batch_id,
                    model=slot.name,
                    size=len(requests),
                    ok=len(requests) - errors,
                    errors=errors,
                    queue_wait_ms=tuple(waits_ms),
                    loaded=loaded,
                    compute_s=compute_s,
                    decision=reason,
                )
            )

    async def _predict_isolating(self, slot: _Slot, requests: list[_Request], outputs: dict[int, Any]) -> None:
        """Run the batch; if the handler raises, bisect so good requests are still served and only
        the poison ones get ``model_failed``."""
        try:
            results = await anyio.to_thread.run_sync(slot.handler.predict, [r.value for r in requests])
            if len(results) != len(requests):
                raise RuntimeError(f"handler returned {len(results)} outputs for {len(requests)} inputs")
        except Exception as exc:  # noqa: BLE001 - handler code is user code
            if len(requests) == 1:
                requests[0].error = (ErrorCode.MODEL_FAILED, f"{type(exc).__name__}: {exc}")
                requests[0].exception = exc
                return
            mid = len(requests) // 2
            await self._predict_isolating(slot, requests[:mid], outputs)
            await self._predict_isolating(slot, requests[mid:], outputs)
            return
        for r, out in zip(requests, results):
            outputs[id(r)] = out

    async def _reply_and_ack(
        self,
        slot: _Slot,
        batch_id: str,
        requests: list[_Request],
        outputs: dict[int, Any],
        waits_ms: list[float],
        loaded: bool,
        trace_id: str,
        *,
        batch_size: int | None = None,
    ) -> int:
        errors = 0
        base = {
            Headers.BATCH_ID: batch_id,
            Headers.BATCH_SIZE: str(batch_size if batch_size is not None else len(requests)),
            Headers.MODEL_LOADED: "true" if loaded else "false",
            Headers.MODEL: slot.name,
            Headers.WORKER: self.worker_id,
        }
        if trace_id:
            base[Headers.TRACE_ID] = trace_id
        for r, wait_ms in zip(requests, waits_ms):
            headers = dict(base)
            headers[Headers.REQUEST_ID] = r.request_id
            headers[Headers.QUEUE_WAIT_MS] = f"{wait_ms:.3f}"
            if r.error is None:
                try:
                    body, ctype = slot.handler.encode(outputs[id(r)])
                except Exception as exc:  # noqa: BLE001
                    r.error = (ErrorCode.MODEL_FAILED, f"cannot encode output: {exc}")
            if r.error is not None:
                code, message = r.error
                body, ctype = encode_error(code, message, r.request_id), ContentType.JSON
                headers[Headers.STATUS] = Status.ERROR.value
                headers[Headers.ERROR_CODE] = code.value
                errors += 1
            else:
                headers[Headers.STATUS] = Status.OK.value
            headers[Headers.CONTENT_TYPE] = ctype.value
            status = r.error[0].value if r.error else "ok"
            self.telemetry.requests.add(1, {"jetbatch.model": slot.name, "jetbatch.status": status})
            if r.reply_to is not None:
                try:
                    await self.nc.publish(r.reply_to, body, headers=headers)
                except nats.errors.MaxPayloadError:
                    fallback = encode_error(ErrorCode.MODEL_FAILED, "output is over the server's max payload", r.request_id)
                    headers.update({Headers.STATUS: Status.ERROR.value, Headers.ERROR_CODE: ErrorCode.MODEL_FAILED.value})
                    headers[Headers.CONTENT_TYPE] = ContentType.JSON.value
                    await self.nc.publish(r.reply_to, fallback, headers=headers)
            elif r.error is None:
                log.warning("request %s has no %s header: result dropped", r.request_id, Headers.REPLY_TO)
        for r in requests:
            if r.error is not None and r.error[0] is ErrorCode.MODEL_FAILED and r.deliveries >= self.config.streams.max_deliver:
                await dead_letter(self.js, self.subjects, "worker", r.msg, r.error[1])
        # Replies were written to the connection before the acks, so the server sees each reply
        # before its ack: a crash in between redelivers, it never loses a request.
        for r in requests:
            try:
                if r.error is not None and r.error[0] is ErrorCode.BAD_REQUEST:
                    await r.msg.term()  # a malformed request will not get better on redelivery
                else:
                    await r.msg.ack()
            except nats.errors.Error as exc:
                log.warning("ack of %s failed: %r", r.request_id, exc)
        try:
            await self.nc.flush(timeout=5)
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("flush after batch %s failed: %r", batch_id, exc)
        return errors

    # --- loads -----------------------------------------------------------------------------

    async def _claim_load(self, slot: _Slot) -> bool:
        """Before paying a load, give peers that decided the same a moment to say so, and stand
        back if one of them now covers this model's backlog (workers must not all chase one queue)."""
        if self.cluster is None or not self.cluster.peers():
            return True
        await anyio.sleep(random.uniform(0.0, min(0.1, self.config.worker.heartbeat_s / 4)))
        served = self.cluster.served_drain_rps().get(slot.name, 0.0)
        if effective_backlog(slot.backlog, served, self.costs.load_cost_s(slot.name), resident_here=False) == 0:
            return False
        self._loading = slot.name
        await self.cluster.advertise(self.advert())
        return True

    async def _load(self, slot: _Slot, evict: Sequence[str], *, reason: str) -> None:
        if not await self._claim_load(slot):
            return
        self._loading = slot.name
        try:
            await self._do_load(slot, evict, reason=reason)
        finally:
            self._loading = None
            if self.cluster is not None:
                await self.cluster.advertise(self.advert())

    async def _do_load(self, slot: _Slot, evict: Sequence[str], *, reason: str) -> None:
        # Wait outside the device lock: the victims' in-flight batches need it to finish.
        for name in evict:
            victim = self.slots[name]
            await self._wait_for(lambda: victim.in_flight == 0)
        unloads: list[tuple[str, int, int, int]] = []  # (model, start_ns, end_ns, bytes) for the model.unload spans
        async with self._device_lock:
            for name in evict:
                victim = self.slots[name]
                started_ns = time.time_ns()
                await self._unload(victim)
                unloads.append((name, started_ns, time.time_ns(), self.costs.memory_bytes(name)))
                self.stats["evictions"] += 1
                self.telemetry.evictions.add(1, {"jetbatch.model": name})
            if slot.resident:
                return
            started = time.perf_counter()
            started_ns = time.time_ns()
            before = _device_bytes(self.device)
            try:
                await anyio.to_thread.run_sync(slot.handler.load, self.device)
            except Exception as exc:  # noqa: BLE001 - a model that cannot load must not stop the worker
                with self.telemetry.child_span("model.load", **{"jetbatch.model": slot.name}) as span:
                    self.telemetry.mark_error(span, exc)
                log.error("loading model %s failed: %s", slot.name, exc)
                await self._fail_queue(slot, f"model {slot.name} failed to load: {exc}")
                return
            seconds = time.perf_counter() - started
            after = _device_bytes(self.device)
            memory = (after - before) if (after is not None and before is not None and after > before) else slot.handler.memory_bytes()
            slot.pending_load = LoadRecord(slot.name, started_ns, time.time_ns(), memory, tuple(evict), unloads)
            slot.resident = True
            slot.fresh_load = True
            slot.weights_read = False
            self._current = slot.name
            self.costs.observe_load(slot.name, seconds)
            self.costs.observe_memory(slot.name, memory)
            self.policy.on_loaded(slot.name, time.time())
            self.stats["loads"] += 1
            self.telemetry.loads.add(1, {"jetbatch.model": slot.name})
            self.telemetry.load_duration.record(seconds, {"jetbatch.model": slot.name})
            self.telemetry.switches.add(1, {"jetbatch.reason": reason})
            log.info("loaded %s in %.3fs (%s bytes), evicted %s", slot.name, seconds, memory, list(evict) or "none")
            if self.on_load is not None:
                self.on_load(LoadReport(slot.name, seconds, tuple(evict), memory))

    async def _unload(self, slot: _Slot) -> None:
        started = time.perf_counter()
        await anyio.to_thread.run_sync(slot.handler.unload)
        if self.device.type == "cuda":
            # Reference cycles can pin device memory until a collection; on the CPU the
            # refcount drop frees it, and a full collection would cost ~0.1 s per switch.
            gc.collect()
        seconds = time.perf_counter() - started
        slot.resident = False
        slot.pending_load = None
        slot.fresh_load = False
        self.policy.on_evicted(slot.name, time.time())
        self.telemetry.unload_duration.record(seconds, {"jetbatch.model": slot.name})

    async def _fail_queue(self, slot: _Slot, message: str) -> None:
        """A model that cannot load: answer one batch of its waiting requests with model_failed so
        callers learn it now, instead of waiting for their timeouts."""
        msgs = await self._fetch(slot, slot.config.max_batch_size, 0.05)
        for m in msgs:
            req = self._parse(m, time.time())
            if req.reply_to:
                headers = {
                    Headers.STATUS: Status.ERROR.value,
                    Headers.ERROR_CODE: ErrorCode.MODEL_FAILED.value,
                    Headers.REQUEST_ID: req.request_id,
                    Headers.MODEL: slot.name,
                    Headers.CONTENT_TYPE: ContentType.JSON.value,
                }
                await self.nc.publish(req.reply_to, encode_error(ErrorCode.MODEL_FAILED, message, req.request_id), headers=headers)
            await m.ack()
        slot.backlog = max(0, slot.backlog - len(msgs))

    def _maybe_prefetch(self, tg: anyio.abc.TaskGroup, *, exclude: str) -> None:
        """Read the likely next model's weights into host memory while the device computes, so a
        switch pays only the host-to-device copy."""
        if not self.config.worker.prefetch_weights:
            return
        waiting = [s for s in self.slots.values() if not s.resident and s.backlog > 0 and s.name != exclude]
        if not waiting:
            return
        nxt = max(waiting, key=lambda s: s.backlog)
        if nxt.weights_read or nxt.name in self._prefetching:
            return
        self._prefetching.add(nxt.name)

        async def read() -> None:
            try:
                await anyio.to_thread.run_sync(nxt.handler.read_weights)
                nxt.weights_read = True
            except Exception as exc:  # noqa: BLE001 - the real load reports the error
                log.debug("prefetch of %s failed: %r", nxt.name, exc)
            finally:
                self._prefetching.discard(nxt.name)

        tg.start_soon(read)

    # --- state -----------------------------------------------------------------------------

    async def _refresh_backlog(self, now: float) -> None:
        self._last_refresh = now
        try:
            info = await self.js.stream_info(self.subjects.models_stream, subjects_filter=self.subjects.models_wildcard)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            log.debug("stream info failed: %r", exc)
            return
        counts: Mapping[str, int] = info.state.subjects or {}
        for slot in self.slots.values():
            stored = counts.get(self.subjects.model(slot.name), 0)
            # Work-queue streams keep a message until it is acked: ours in flight are not backlog.
            mine = sum(1 for m in self._in_flight_msgs.values() if m.subject == self.subjects.model(slot.name))
            slot.backlog = max(0, stored - mine)
            if slot.backlog == 0:
                slot.oldest_enqueued_at = None
        for slot in self.slots.values():
            if slot.backlog > 0:
                slot.oldest_enqueued_at = await self._oldest(slot, now)

    async def _oldest(self, slot: _Slot, now: float) -> float | None:
        try:
            raw = await self.js.get_msg(self.subjects.models_stream, seq=1, subject=self.subjects.model(slot.name), next=True)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
            return slot.oldest_enqueued_at or now
        ts = _raw_timestamp(raw)
        return min(ts, now) if ts is not None else now

    def advert(self) -> WorkerAdvert:
        """What this worker tells its peers."""
        drain: dict[str, float] = {}
        for s in self.slots.values():
            if s.resident or s.name == self._loading:
                n = s.config.max_batch_size
                drain[s.name] = n / max(self.costs.batch_cost(s.name).seconds(n), 1e-6)
        return WorkerAdvert(
            id=self.worker_id,
            models=list(self.slots),
            resident=[s.name for s in self.slots.values() if s.resident],
            loading=self._loading,
            drain_rps=drain,
            load_cost_s={name: self.costs.load_cost_s(name) for name in self.slots},
            memory_used_bytes=sum(self.costs.memory_bytes(s.name) for s in self.slots.values() if s.resident),
            memory_budget_bytes=self.budget.max_bytes,
            updated_at=time.time(),
        )

    async def _advertise_loop(self) -> None:
        assert self.cluster is not None
        while True:
            await anyio.sleep(self.config.worker.heartbeat_s)
            await self.cluster.advertise(self.advert())

    def _state(self) -> sched.SchedulerState:
        served = self.cluster.served_drain_rps() if self.cluster is not None else {}
        models = {}
        for name, slot in self.slots.items():
            cfg = slot.config
            # Work other workers will drain before a load of ours would finish is not ours to chase.
            backlog = effective_backlog(
                slot.backlog, served.get(name, 0.0), self.costs.load_cost_s(name), resident_here=slot.resident
            )
            models[name] = sched.ModelState(
                name=name,
                backlog=backlog,
                oldest_enqueued_at=slot.oldest_enqueued_at if backlog else None,
                resident=slot.resident,
                load_cost_s=self.costs.load_cost_s(name),
                batch_cost=self.costs.batch_cost(name),
                memory_bytes=self.costs.memory_bytes(name),
                max_batch_size=cfg.max_batch_size,
                max_wait_s=cfg.max_wait_ms / 1000.0,
                last_used_at=slot.last_used_at,
            )
        return sched.SchedulerState(models=models, current=self._current, budget=self.budget)

    async def _heartbeat_loop(self) -> None:
        """Tell JetStream that in-flight messages are still being worked on (long loads and long
        batches), so they are not redelivered to another worker meanwhile."""
        interval = max(self.config.streams.ack_wait_s / 3.0, 0.05)
        while True:
            await anyio.sleep(interval)
            for msg in list(self._in_flight_msgs.values()):
                try:
                    await msg.in_progress()
                except nats.errors.Error:
                    pass


def _stream_seq(r: _Request) -> int:
    try:
        return int(r.msg.metadata.sequence.stream)
    except Exception:  # noqa: BLE001
        return 0


def _enqueued_at(msg: Msg, fallback: float) -> float:
    try:
        return min(msg.metadata.timestamp.timestamp(), fallback)
    except Exception:  # noqa: BLE001 - metadata is absent only on non-JetStream messages
        return fallback


def _pending_after(msg: Msg, fallback: int) -> int:
    try:
        return int(msg.metadata.num_pending)
    except Exception:  # noqa: BLE001
        return max(0, fallback)


def _raw_timestamp(raw: Any) -> float | None:
    ts = getattr(raw, "time", None)
    if ts is None:
        return None
    if hasattr(ts, "timestamp"):
        return float(ts.timestamp())
    try:
        from datetime import datetime

        return datetime.fromisoformat(str(ts).replace("Z", "+00:00")[:26] + "+00:00").timestamp()
    except ValueError:
        return None


def _device_bytes(device: Any) -> int | None:
    try:
        import torch

        if device.type == "cuda":
            return int(torch.cuda.memory_allocated(device))
    except Exception:  # noqa: BLE001
        return None
    return None


def _error_status(message: str) -> Any:
    from opentelemetry.trace import Status as OtelStatus, StatusCode

    return OtelStatus(StatusCode.ERROR, message)


class _Costs:
    """Exponentially weighted measurements of load time, batch time (fixed + per item) and memory,
    seeded from the configuration."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self._load: dict[str, float] = {}
        self._batch: dict[str, sched.BatchCost] = {}
        self._memory: dict[str, int] = {}

    def seed(self, model: str, *, load_cost_s: float, batch_cost: sched.BatchCost, memory_bytes: int) -> None:
        self._load[model] = load_cost_s
        self._batch[model] = batch_cost
        self._memory[model] = memory_bytes

    def observe_load(self, model: str, seconds: float) -> None:
        self._load[model] = (1 - self.alpha) * self._load.get(model, seconds) + self.alpha * seconds

    def observe_batch(self, model: str, n: int, seconds: float) -> None:
        # Keep the fixed part and refit the per-item part from this observation.
        cost = self._batch.get(model, sched.BatchCost(0.0, 0.0))
        per_item = max(0.0, (seconds - cost.fixed_s) / max(n, 1))
        fixed = max(0.0, seconds - cost.per_item_s * n)
        a = self.alpha
        self._batch[model] = sched.BatchCost((1 - a) * cost.fixed_s + a * fixed, (1 - a) * cost.per_item_s + a * per_item)

    def observe_memory(self, model: str, nbytes: int) -> None:
        if nbytes > 0:
            self._memory[model] = nbytes

    def load_cost_s(self, model: str) -> float:
        return self._load.get(model, 1.0)

    def batch_cost(self, model: str) -> sched.BatchCost:
        return self._batch.get(model, sched.BatchCost(0.005, 0.0005))

    def memory_bytes(self, model: str) -> int:
        return self._memory.get(model, 0)
