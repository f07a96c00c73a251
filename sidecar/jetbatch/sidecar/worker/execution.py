"""Running one batch: check each request, compute the good ones, answer every one, settle.

Per batch: requests with invalid headers get ``bad_request`` (or, when their reply subject was
refused, a dead letter and no publish at all); expired ones get ``deadline_exceeded`` without
compute; first-time requests run as one batch (bisected if the handler raises, so only the
failing ones get ``model_failed``); redelivered ones (suspects) then run in the groups the
quarantine's evidence allows: together without evidence, a crashed group cut into parts
(worker/quarantine.py). Every answer is stored and sent before its
message is acked (replies.py).
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from typing import Any, Awaitable, Callable

import anyio
from nats.aio.msg import Msg

from jetbatch.sdk.protocol import (
    ErrorCode, Headers, ReplyPolicy, batch_header_of, new_request_id,
    parse_request_headers, validate_tenant,
)  # fmt: skip

from ..handlers import BadInput
from ..core import BatchChecked, BatchDone, WorkerCore
from ..policy import cannot_finish
from ..replies import Answer, Replier, client_message, settle
from ..telemetry import LoadRecord, WorkerTelemetry
from .counters import Counters
from .slots import BatchReport, ModelTurn, Request, Slot, ack_info
from .quarantine import Evidence, Quarantine, Verdict, groups
from .triage import as_asked, too_late, triage, with_problem

__all__ = ["GIVE_BACK_DELAY_S", "BatchRunner"]

# A request given back because its answer could not be made safe (the results store refused it,
# or the batch failed inside jetbatch) is delivered again this long after (a nak's delay): time
# for the store to recover, and not a spin.
GIVE_BACK_DELAY_S = 1.0

_CANCELLED = "cancelled by its caller before it was computed"

log = logging.getLogger("jetbatch.worker")


class BatchRunner:
    def __init__(
        self,
        *,
        worker_id: str,
        replier: Replier,
        quarantine: Quarantine,
        telemetry: WorkerTelemetry,
        core: WorkerCore,
        reply_policy: ReplyPolicy,
        max_deliver: int,
        counters: Counters,
        device_lock: anyio.Lock,
        on_batch: Callable[[BatchReport], None] | None = None,
        clock: Callable[[], float] = time.time,
        cancelled: Callable[[str | None, str], bool] = lambda tenant, request_id: False,
        on_settled: Callable[[Slot, list[Msg], float | None], Awaitable[None]] | None = None,
    ) -> None:
        """``clock``: wall-clock seconds, the scale of deadlines and enqueue times (tests pass a
        fake one); a batch's compute time is measured with :attr:`timer`. ``on_settled``: told of
        the messages of each :meth:`finish` once they are acked, termed or naked, before the
        rest of their batch is done (redelivered requests are looked up and run after the
        others): the stream's count drops them at once, and what the worker and its peers count
        as held must too, or subtracted from that count again they hid as many waiting ones. Its
        third argument: in how many seconds a request given back with a delay (its answer not
        stored) is delivered again, None when none was: it comes back with no arrival event."""
        self._on_settled = on_settled
        self._clock = clock
        # What a forward pass is timed with (the device time the estimator learns); tests replace it.
        self.timer: Callable[[], float] = time.perf_counter
        self._cancelled = cancelled  # (tenant, request id): whether its caller said it gave up
        # The id travels inside the ``Jetbatch-Batch`` header, whose fields ``;`` and ``=`` separate.
        self.worker_id = worker_id.replace(";", "_").replace("=", "_")
        self.replier = replier
        self.quarantine = quarantine
        self.telemetry = telemetry
        self.core = core  # told of each batch's checks and end; its estimates read
        self.reply_policy = reply_policy
        self.max_deliver = max_deliver
        self._counters = counters
        # Held only while the model computes: storing and sending answers is I/O, and holding the
        # device through it kept the next batch (or a load) waiting on the network.
        self.device_lock = device_lock
        self.on_batch = on_batch
        self._rng = random.Random()

    # --- parsing --------------------------------------------------------------------------------

    def parse(self, msg: Msg, now: float) -> Request:
        """Check a message's headers (never raises)."""
        headers = msg.headers or {}
        tenant = headers.get(Headers.TENANT)
        tenant_problem = None
        if tenant is not None:
            try:
                validate_tenant(tenant)
            except Exception as exc:  # noqa: BLE001 - ProtocolError; any failure is the request's
                tenant_problem, tenant = str(exc), None
        meta = parse_request_headers(headers, policy=self.reply_policy, tenant=tenant, fallback_id=new_request_id)
        if tenant_problem:
            meta = with_problem(meta, f"header {Headers.TENANT}: {tenant_problem}")
        ack = ack_info(msg)
        return Request(
            msg=msg,
            meta=meta,
            deliveries=1 if ack is None else ack.delivered,
            seq=0 if ack is None else ack.stream_seq,
            enqueued_at=now if ack is None else min(ack.stored_at_s, now),
            reply_refused=meta.reply_key is None and Headers.REPLY_TO in headers and meta.reply_to is None,
        )

    # --- one batch ------------------------------------------------------------------------------

    async def run(
        self,
        slot: Slot,
        msgs: list[Msg],
        loaded: bool,
        reason: str,
        turn: ModelTurn,
        load_record: LoadRecord | None = None,
    ) -> None:
        """Check, compute, answer and settle one batch. The model is taken (``turn.take``) right
        before each forward pass: the batch before may still compute, and this one's checks,
        decoding and stored-answer lookups overlap it. It is given up once no forward pass
        follows (before the answers' I/O), so that an eviction, and the next batch, wait for the
        device work only. ``compute_s`` (what the estimator learns, and the simulator charges the
        device) is the first-time requests' forward pass alone: the wait for the model and the
        decoding that overlaps the batch before do not count."""
        batch_id = uuid.uuid4().hex[:16]
        now = self._clock()
        requests = [self.parse(m, now) for m in msgs]
        waits_ms = {id(r): max(0.0, (now - r.enqueued_at) * 1000.0) for r in requests}
        # The Jetbatch-Batch header, given a request's wait (with the span's trace id once it exists).
        batch_value = batch_header_of(batch_id, len(requests), loaded, self.worker_id)

        def extra(r: Request) -> dict[str, str]:
            return {Headers.MODEL: slot.name, Headers.BATCH: batch_value(waits_ms[id(r)])}

        predicted_s = self.core.predicted_s(slot.name, len(requests))  # the core's probe rule
        rejected, expired, fresh, suspects = triage(requests, now, predicted_s)
        # A caller that cancelled is gone: its request is answered `cancelled`, not computed (a
        # suspect, or one late anyway, too), as the simulator counts it.
        gone = [r for r in expired + fresh + suspects if self._cancelled(r.meta.tenant, r.meta.request_id)]
        if gone:
            expired = [r for r in expired if r not in gone]
            fresh = [r for r in fresh if r not in gone]
            suspects = [r for r in suspects if r not in gone]
            self._counters.add("cancelled", len(gone))
        compute_s = 0.0
        computed = excess = 0
        with self.telemetry.batch_span(
            slot.name,
            [r.msg.headers for r in requests],
            batch_id=batch_id,
            waits_ms=list(waits_ms.values()),
            decision=reason,
            loaded=loaded,
            start_ns=load_record.start_ns if load_record else None,
        ) as span:
            if load_record is not None:
                self.telemetry.record_load(load_record, span)
            trace_id = self.telemetry.trace_id_hex(span)
            if trace_id:
                batch_value = batch_header_of(batch_id, len(requests), loaded, self.worker_id, trace_id)
            for r in rejected:
                r.action = "term"  # a malformed request will not get better on redelivery
                r.answer = Answer.failure(r.meta, ErrorCode.BAD_REQUEST, r.meta.problem or "bad request", extra(r))
            for r in gone:
                r.answer = Answer.failure(r.meta, ErrorCode.CANCELLED, _CANCELLED, extra(r))
            for r in expired:
                r.answer = Answer.failure(r.meta, ErrorCode.DEADLINE_EXCEEDED, too_late(r, now, predicted_s), extra(r))
            self._decode(slot, fresh, extra)
            good = [r for r in fresh if r.answer is None]
            late = 0
            if good:
                await turn.take()
                # Checked again at the forward pass, as the simulator checks at a batch's start:
                # a caller may have cancelled, or a deadline come closer, while the batch before
                # computed.
                now = self._clock()
                for r in good:
                    if self._cancelled(r.meta.tenant, r.meta.request_id):
                        r.answer = Answer.failure(r.meta, ErrorCode.CANCELLED, _CANCELLED, extra(r))
                        self._counters.add("cancelled")
                    elif cannot_finish(r.meta.deadline, now, predicted_s):
                        r.answer = Answer.failure(r.meta, ErrorCode.DEADLINE_EXCEEDED, too_late(r, now, predicted_s), extra(r))
                        late += 1
                good = [r for r in good if r.answer is None]
            # A batch refused whole on a prediction teaches the estimator nothing: the core
            # counts them, and after a few in a row has one computed (``WorkerCore.predicted_s``).
            refused_whole = predicted_s > 0 and (bool(expired) or late > 0) and len(expired) + late == len(requests)
            self.core.handle(BatchChecked(slot.name, refused_whole))
            if good:
                started = self.timer()
                with self.telemetry.child_span("infer", **{"jetbatch.model": slot.name, "jetbatch.batch.size": len(good)}):
                    await self._predict_isolating(slot, good, extra)
                compute_s = self.timer() - started
                computed = len(good)
                rules = self.core.rules[slot.name]
                self._counters.sample("compute_excess", compute_s - rules.batch_cost_s - rules.item_cost_s * computed)
                excess = sum(1 for r in good if (r.msg.headers or {}).get(Headers.EXCESS) == "1")
                self.telemetry.infer_duration.record(compute_s, {"jetbatch.model": slot.name})
                self.telemetry.tenants_computed([r.meta.tenant for r in good], compute_s)
            if suspects:
                turn.lend()  # their lookups are I/O: another batch may compute meanwhile
            else:
                turn.release()
            await self.finish(slot, rejected + expired + gone + fresh)
            await self._run_suspects(slot, suspects, extra, turn)
            turn.release()
            self._record_errors(span, requests)
        # What ran teaches the estimator; every request taken counts as demand (policy/driver.py).
        self.core.handle(BatchDone(slot.name, taken=len(requests), computed=computed, seconds=compute_s, now=self._clock(), excess=excess))
        self._counters.add("batches")
        self._counters.add("requests", len(requests))
        if self.on_batch is not None:
            n_errors = sum(1 for r in requests if r.answer is None or r.answer.error is not None)
            self.on_batch(
                BatchReport(
                    batch_id=batch_id, model=slot.name, size=len(requests), ok=len(requests) - n_errors, errors=n_errors,
                    queue_wait_ms=tuple(waits_ms[id(r)] for r in requests), loaded=loaded, compute_s=compute_s, decision=reason,
                )
            )  # fmt: skip

    def _record_errors(self, span: Any, requests: list[Request]) -> None:
        """Each failed request as an event on the batch span; the span an error when a model
        failure or every request failed."""
        errors = [r for r in requests if r.answer is not None and r.answer.error is not None]
        if not errors:
            return
        span.set_attribute("jetbatch.batch.errors", len(errors))
        for r in errors:
            assert r.answer is not None and r.answer.error is not None
            span.add_event("request.error", {"jetbatch.request.id": r.meta.request_id, "jetbatch.error.code": r.answer.error.value})
            if r.exception is not None:
                span.record_exception(r.exception, {"jetbatch.request.id": r.meta.request_id})
        failed = [r for r in errors if r.answer and r.answer.error in (ErrorCode.MODEL_FAILED, ErrorCode.INTERNAL)]
        if failed or len(errors) == len(requests):
            worst = (failed or errors)[0].answer
            code = worst.error.value if worst is not None and worst.error is not None else "internal"
            self.telemetry.mark_status_error(span, f"{len(errors)} of {len(requests)} requests failed", code)

    def _decode(self, slot: Slot, requests: list[Request], extra: Callable[[Request], dict[str, str]]) -> None:
        for r in requests:
            try:
                r.value = slot.handler.decode(r.msg.data, r.meta.content_type)
            except BadInput as exc:
                r.action = "term"
                r.answer = Answer.failure(r.meta, ErrorCode.BAD_REQUEST, str(exc), extra(r))
            except Exception as exc:  # noqa: BLE001 - a custom decode must not take the batch down
                r.action = "term"
                r.answer = Answer.failure(r.meta, ErrorCode.BAD_REQUEST, f"cannot decode payload: {client_message(exc)}", extra(r))

    async def _predict_isolating(self, slot: Slot, requests: list[Request], extra: Callable[[Request], dict[str, str]]) -> None:
        """Run the batch; if the handler raises, bisect so good requests are still served and only
        the failing ones get ``model_failed``."""
        try:
            async with self.device_lock:
                results = await self._forward(slot, [r.value for r in requests])
            if len(results) != len(requests):
                raise RuntimeError(f"handler returned {len(results)} outputs for {len(requests)} inputs")
        except Exception as exc:  # noqa: BLE001 - handler code is user code
            if len(requests) == 1:
                r = requests[0]
                r.exception = exc
                log.info("model %s failed on request %s: %s", slot.name, r.meta.request_id, exc)
                r.answer = Answer.failure(r.meta, ErrorCode.MODEL_FAILED, client_message(exc), extra(r))
                return
            mid = len(requests) // 2
            await self._predict_isolating(slot, requests[:mid], extra)
            await self._predict_isolating(slot, requests[mid:], extra)
            return
        for r, out in zip(requests, results):
            try:
                body, ctype = as_asked(*slot.handler.encode(out), r.meta.content_type)
                r.answer = Answer.ok(r.meta, body, ctype, extra(r))
            except Exception as exc:  # noqa: BLE001
                r.answer = Answer.failure(r.meta, ErrorCode.MODEL_FAILED, f"cannot encode output: {client_message(exc)}", extra(r))

    async def _forward(self, slot: Slot, values: list[Any]) -> list[Any]:
        """One forward pass: in a worker thread, so that the event loop serves the queues (pulls,
        answers, PubAcks) while the model computes; on the event loop itself when the handler
        declares ``predict`` cheap and bounded (:attr:`Handler.inline`), where a thread's round
        trip would cost more than the pass (about 0.11 ms of CPU: ``python -m bench.overhead.thread_hop``)."""
        if slot.handler.inline:
            return slot.handler.predict(values)
        return await anyio.to_thread.run_sync(slot.handler.predict, values)

    async def _run_suspects(self, slot: Slot, suspects: list[Request], extra: Callable[[Request], dict[str, str]], turn: ModelTurn) -> None:
        """Redelivered requests: answered from the results store if an earlier delivery was
        computed, convicted on evidence, given up on after too many deliveries, or run in the
        groups their evidence allows (``quarantine.groups``). The model is taken for each
        group's forward pass only, not for the lookups."""
        if not suspects:
            return
        to_run: list[tuple[Request, Evidence]] = []
        for r in sorted(suspects, key=lambda r: r.seq):
            stored = await self.replier.stored_answer(r.meta)
            if stored is not None:
                r.answer = stored
                await self.finish(slot, [r])
                await self.quarantine.clear(slot.name, r.seq)
                continue
            evidence = await self.quarantine.evidence(slot.name, r.seq)
            verdict = self.quarantine.verdict(r.deliveries, evidence)
            if verdict is Verdict.RUN_ALONE:
                to_run.append((r, evidence))
                continue
            if verdict is Verdict.CULPRIT:
                reason = f"request crashed the worker {evidence.crashes} times while it ran ({evidence.alone_crashes} of them alone)"
            else:
                reason = f"request was delivered {r.deliveries} times without completing (workers died while it was in flight)"
            log.warning("model %s: request %s: %s", slot.name, r.meta.request_id, reason)
            r.answer = Answer.failure(r.meta, ErrorCode.MODEL_FAILED, reason, extra(r))
            await self.replier.dead_letter(r.msg, reason, "worker")
            await self.finish(slot, [r])
            await self.quarantine.clear(slot.name, r.seq)
        # Weakest evidence first, equals in a random order (``quarantine.groups``).
        plan = groups([(r.seq, ev) for r, ev in to_run], rng=self._rng)
        for indices in plan:
            group = [to_run[i] for i in indices]
            members = [r for r, _ in group]
            self._decode(slot, members, extra)
            runnable = [(r, ev) for r, ev in group if r.answer is None]
            if runnable:
                # The evidence window is the model's own code: recorded just before it runs,
                # cleared as soon as it returns.
                tag = min(r.seq for r, _ in runnable)  # tells this group's crash from another's
                for r, ev in runnable:
                    await self.quarantine.begin(slot.name, r.seq, ev, len(runnable), tag)
                attrs = {"jetbatch.model": slot.name, "jetbatch.batch.size": len(runnable), "jetbatch.redelivered": True}
                await turn.take()
                with self.telemetry.child_span("infer", **attrs):
                    await self._predict_isolating(slot, [r for r, _ in runnable], extra)
                turn.lend()
                for r, _ in runnable:
                    await self.quarantine.clear(slot.name, r.seq)
            await self.finish(slot, members)

    async def finish(self, slot: Slot | str, requests: list[Request]) -> None:
        """Store and send the answers of ``requests``, then settle each message. ``slot``: the
        model's slot, or the name of a model this worker does not register (worker/orphans.py:
        nothing of its arrivals is counted here)."""
        if not requests:
            return
        fresh_answers = [r.answer for r in requests if r.answer is not None and not r.answer.stored]
        stored_answers = [r.answer for r in requests if r.answer is not None and r.answer.stored]
        if fresh_answers:
            started = time.perf_counter()
            await self.replier.deliver(fresh_answers)  # type: ignore[arg-type]
            self._counters.sample("answer", time.perf_counter() - started)
        for a in stored_answers:
            if a is not None:
                await self.replier.resend(a)
        outcomes: dict[str, int] = {}
        back_in_s: float | None = None
        for r in requests:
            a = r.answer
            if a is None:  # cannot happen: every path sets an answer
                continue
            outcome = a.error.value if a.error else "ok"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            if r.reply_refused:
                # Nowhere safe to answer: keep the request, with the reason, for an operator.
                await self.replier.dead_letter(r.msg, r.meta.problem or "reply subject refused", "worker")
            if self.replier.safe(a) or r.reply_refused:
                await settle(r.msg, r.action)
            elif r.deliveries >= self.max_deliver:
                # The results store has refused this answer delivery after delivery: it was sent
                # live; stop recomputing it.
                log.error("answer of %s could not be stored after %d deliveries; acked after the live reply", r.meta.request_id, r.deliveries)
                await settle(r.msg, r.action)
            else:
                # Redelivered; its next delivery finds it stored or recomputes it.
                await settle(r.msg, "nak", delay_s=GIVE_BACK_DELAY_S)
                back_in_s = GIVE_BACK_DELAY_S
        if self._on_settled is not None and not isinstance(slot, str):
            await self._on_settled(slot, [r.msg for r in requests], back_in_s)
        model = slot if isinstance(slot, str) else slot.name
        for outcome, count in outcomes.items():  # one metric update per outcome and batch, not per request
            self.telemetry.requests.add(count, {"jetbatch.model": model, "jetbatch.status": outcome})
        self.telemetry.tenants_answered([(r.meta.tenant, r.answer.error.value if r.answer.error else "ok") for r in requests if r.answer is not None])
