"""Every JetStream stream and consumer jetbatch uses, with their configs, in one place.

Streams are created idempotently at startup: created when missing, updated when they differ from
the configuration (logged), and a clear :class:`StreamSetupError` when the server refuses the
change (for example a retention change, which JetStream forbids).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Iterable

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RePublish,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from jetbatch.sdk import failures
from jetbatch.sdk.protocol import Priority, ProtocolError, Subjects, validate_model_name

from .config import RepliesConfig, StreamsConfig
from .errors import SidecarError
from .registry import register_models

__all__ = [
    "StreamSetupError",
    "classifier_consumer_config",
    "classifier_consumer_name",
    "dead_letter_stream_config",
    "ensure_classifier_streams",
    "ensure_model_consumer",
    "ensure_model_consumers",
    "ensure_streams",
    "ingress_stream_config",
    "model_consumer_config",
    "model_consumer_name",
    "models_stream_config",
    "progress_interval_s",
    "results_stream_config",
]

log = logging.getLogger("jetbatch.streams")


class StreamSetupError(SidecarError):
    """A stream or consumer could not be created or brought in line with the configuration.
    ``transient``: JetStream did not answer (worth retrying), rather than a configuration conflict."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


def ingress_stream_config(subjects: Subjects, cfg: StreamsConfig) -> StreamConfig:
    """``<prefix>.in`` and ``<prefix>.in.<tenant>``: requests waiting for the classifier."""
    return _work_queue(
        subjects.ingress_stream, [subjects.ingress, subjects.tenant_ingress_wildcard], cfg, "jetbatch requests to classify"
    )


def results_stream_config(subjects: Subjects, cfg: StreamsConfig, replies: RepliesConfig) -> StreamConfig:
    """``<prefix>.result.>``: every final answer (protocol 3: ``<tenant or _>.<reply key>.<request
    id>``, which the caller also receives live; protocol 2: ``[<tenant>.]<request id>``), kept
    ``max_age_s`` so a caller that missed it (a reconnect, a retry under the same id) fetches it
    with a direct get (which a server permission can scope to one tenant's results)."""
    return StreamConfig(
        name=subjects.results_stream,
        description="jetbatch answers, by request id",
        subjects=[subjects.results_wildcard],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,  # a full results store forgets its oldest answers, never blocks serving
        max_msgs_per_subject=1,
        max_bytes=replies.max_bytes,
        max_age=replies.max_age_s,
        max_msg_size=cfg.max_msg_size + 64 * 1024,
        allow_direct=True,
        # With replies.atomic_batches, a batch's answers are stored as one atomic batch,
        # confirmed by one PubAck (nats-server 2.12+; sidecar/replies.py stores them one by one
        # where it is refused). Allowed either way, so sidecars may differ in that setting.
        allow_atomic=True,
        num_replicas=cfg.replicas,
        duplicate_window=min(cfg.duplicate_window_s, replies.max_age_s),
    )


# What the classifier's republish may add to a request's headers (``models_stream_config``).
ROUTING_HEADROOM_BYTES = 1024
# The models stream's consumers at most: two a registered model, for 50 000 of them.
MAX_MODEL_CONSUMERS = 100_000


def models_stream_config(subjects: Subjects, cfg: StreamsConfig) -> StreamConfig:
    """One stream holding every per-model queue: ``<prefix>.model.<name>`` (interactive) and
    ``<prefix>.model.<name>.batch``.

    Its subjects are two wildcards, so its size and the server's work to create it stay the
    same for ten models or a hundred thousand (an explicit list, two subjects a model, took the
    server quadratic time and stopped fitting a default ``max_payload`` near 10 000 models). A
    request for a model nobody registers is refused before it is sent, from the model registry
    (``registry.py``), not by this stream.

    Every stored request's headers (no payload) are republished to ``<prefix>.arrived.<model>``,
    with the stream's sequence and timestamp: the workers learn of arrivals as events, so a
    decision never asks the server about every registered model (docs/scaleout.md). Only stored
    messages are republished: a refused or deduplicated publish is no arrival.
    """
    config = _work_queue(subjects.models_stream, subjects.queue_wildcards, cfg, "jetbatch per-model queues")
    # A request the ingress took whole must fit once routed: the classifier adds the tenant it
    # arrived under and a tenant-scoped dedupe id (a tenant's request at the ingress's limit was
    # refused by this stream as too large).
    config.max_msg_size = cfg.max_msg_size + ROUTING_HEADROOM_BYTES
    # Two consumers a model (its interactive and batch lines). Said explicitly: a stream that
    # leaves it unlimited takes 1 000 consumers at most on nats-server 2.15, so a 500th model's
    # consumer was refused ("maximum consumers limit reached").
    config.max_consumers = MAX_MODEL_CONSUMERS
    config.republish = RePublish(src=subjects.models_wildcard, dest=subjects.arrivals_wildcard, headers_only=True)
    return config


def dead_letter_stream_config(subjects: Subjects, cfg: StreamsConfig) -> StreamConfig:
    """``<prefix>.dlq.<stage>``: requests that could not be served, with their reason in headers."""
    return StreamConfig(
        name=subjects.dead_letter_stream,
        description="jetbatch dead letters",
        subjects=[subjects.dead_letter_wildcard],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,  # a full dead-letter stream drops its oldest entries, never blocks serving
        max_msgs=cfg.max_msgs,
        max_bytes=cfg.max_bytes,
        max_age=cfg.dlq_max_age_s,
        max_msg_size=cfg.max_msg_size + 64 * 1024,  # room for the reason headers
        num_replicas=cfg.replicas,
        duplicate_window=cfg.duplicate_window_s,
    )


def _work_queue(name: str, subjects_list: list[str], cfg: StreamsConfig, description: str) -> StreamConfig:
    return StreamConfig(
        name=name,
        description=description,
        subjects=subjects_list,
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        # A full queue refuses new messages: the producer gets Overloaded instead of a silent drop.
        discard=DiscardPolicy.NEW,
        max_msgs=cfg.max_msgs,
        max_bytes=cfg.max_bytes,
        max_msg_size=cfg.max_msg_size,
        duplicate_window=cfg.duplicate_window_s,
        num_replicas=cfg.replicas,
    )


def progress_interval_s(ack_wait_s: float) -> float:
    """How often a message being worked on gets a progress ack (``+WPI``, ``msg.in_progress()``):
    three a ack wait, so that two lost or late ones still leave it ours. The ack wait itself is
    short (``streams.ack_wait_s``, 5 s) because it is what a killed worker's requests wait before
    anyone else may take them."""
    return max(ack_wait_s / 3.0, 0.05)


def model_consumer_name(model: str, priority: Priority | str = Priority.INTERACTIVE) -> str:
    """The shared consumer of one model's queue of one class: ``model-<m>`` (interactive),
    ``batch-<m>`` (batch; no model name can make one name the other's)."""
    return f"model-{model}" if Priority(priority) is Priority.INTERACTIVE else f"batch-{model}"


def classifier_consumer_name() -> str:
    return "classifier"


def model_consumer_config(subjects: Subjects, cfg: StreamsConfig, model: str, priority: Priority | str = Priority.INTERACTIVE) -> ConsumerConfig:
    """The durable pull consumer every worker shares for one model's queue of one class (a
    worker pulls the interactive one first).

    JetStream's own delivery limit is off (-1): a message that reaches it without an ack would
    stay in the work queue forever, unanswered and counted as backlog. The workers enforce
    ``max_deliver`` themselves and answer every message at its end (see sidecar/quarantine.py).

    With ``consumers = "on-demand"`` the server removes a consumer nobody pulled from for
    ``consumer_idle_s`` (on a replicated stream each consumer is a Raft group: a thousand idle
    ones cost every node CPU); a worker creates it again before it serves the model. The queue
    is the stream's, so nothing waiting is lost with the consumer; messages it had delivered but
    not seen acked are delivered again by the next one.
    """
    name = model_consumer_name(model, priority)
    config = _shared_pull_consumer(name, f"jetbatch workers for model {model} ({Priority(priority).value})", [subjects.model(model, priority)], cfg, max_deliver=-1)
    if cfg.consumers == "on-demand":
        config.inactive_threshold = cfg.consumer_idle_s
    return config


def classifier_consumer_config(subjects: Subjects, cfg: StreamsConfig) -> ConsumerConfig:
    """The durable pull consumer classifier replicas share on ``<prefix>.in`` and its tenants."""
    return _shared_pull_consumer(
        classifier_consumer_name(), "jetbatch classifiers", [], cfg, max_deliver=cfg.max_deliver
    )  # no filter: the ingress stream holds only <prefix>.in and <prefix>.in.<tenant>


def _shared_pull_consumer(
    name: str, description: str, filter_subjects: list[str], cfg: StreamsConfig, *, max_deliver: int
) -> ConsumerConfig:
    """A durable pull consumer with explicit acks that every replica of a role pulls from."""
    return ConsumerConfig(
        durable_name=name,
        description=description,
        filter_subject=filter_subjects[0] if len(filter_subjects) == 1 else None,
        filter_subjects=filter_subjects if len(filter_subjects) > 1 else None,
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=cfg.ack_wait_s,
        max_deliver=max_deliver,
        max_ack_pending=cfg.max_ack_pending,
        max_waiting=512,
        num_replicas=0,  # inherit the stream's replicas
    )


_SETUP_ATTEMPTS = 8

_COMPARED = (
    "retention", "storage", "discard", "max_msgs", "max_bytes", "max_msg_size",
    "duplicate_window", "num_replicas", "max_age", "allow_direct", "max_msgs_per_subject", "republish", "allow_atomic", "max_consumers",
)  # fmt: skip


async def _ensure_stream(js: JetStreamContext, wanted: StreamConfig) -> None:
    """Create ``wanted`` or update the existing stream to match it."""
    assert wanted.name is not None
    for _attempt in range(_SETUP_ATTEMPTS):
        try:
            info = await js.stream_info(wanted.name)
        except failures.NOT_FOUND:
            try:
                await js.add_stream(wanted)
                log.info("created stream %s", wanted.name)
                return
            except failures.BAD_REQUEST as exc:
                if exc.err_code == 10058:  # created concurrently by another sidecar: compare again
                    continue
                raise StreamSetupError(f"cannot create stream {wanted.name}: {exc.description}") from exc
        current = info.config
        subjects = sorted(wanted.subjects or [])
        diffs = [
            f"{key} {getattr(current, key)!r} -> {getattr(wanted, key)!r}"
            for key in _COMPARED
            if getattr(wanted, key) is not None and _norm(getattr(current, key)) != _norm(getattr(wanted, key))
        ]
        if sorted(current.subjects or []) != subjects:
            # An explicit list of models (before the wildcards) is replaced whole: the wildcards
            # take every subject it named, so what waits stays stored.
            shown = current.subjects or []
            diffs.append(f"subjects {shown[:4]!r}{f' and {len(shown) - 4} more' if len(shown) > 4 else ''} -> {subjects}")
        if not diffs:
            return
        updated = StreamConfig.from_response({**current.as_dict(), **wanted.as_dict(), "subjects": subjects})
        try:
            await js.update_stream(updated)
        except failures.API_ERRORS as exc:
            if _attempt < _SETUP_ATTEMPTS - 1:
                # Several sidecars starting together on a cluster update the same stream: read it
                # again and retry before calling it a configuration conflict.
                await asyncio.sleep(0.2 * (_attempt + 1))
                continue
            raise StreamSetupError(
                f"stream {wanted.name} differs from the configuration ({'; '.join(diffs)}) and the server "
                f"refused the update: {exc.description}. Delete the stream or fix the configuration."
            ) from exc
        log.info("updated stream %s: %s", wanted.name, "; ".join(diffs))
        return
    raise StreamSetupError(f"stream {wanted.name} kept changing while it was being set up")


def _norm(value: object) -> object:
    if isinstance(value, RePublish):
        return (value.src, value.dest, bool(value.headers_only))
    if hasattr(value, "value"):
        return getattr(value, "value")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


async def ensure_streams(
    js: JetStreamContext, subjects: Subjects, cfg: StreamsConfig, models: Iterable[str], replies: RepliesConfig | None = None
) -> None:
    """Create or update the models, dead-letter and results streams for a worker serving
    ``models``, and write ``models`` into the model registry first (with any model the models
    stream still lists by name, from before its wildcards: their requests stay servable)."""
    try:
        earlier = await _listed_models(js, subjects)
        await register_models(js, subjects, cfg, {*models, *earlier})
        await _ensure_stream(js, models_stream_config(subjects, cfg))
        await _ensure_stream(js, dead_letter_stream_config(subjects, cfg))
        if replies is not None and replies.durable:
            await _ensure_stream(js, results_stream_config(subjects, cfg, replies))
    except failures.TIMEOUTS + failures.UNAVAILABLE as exc:
        raise StreamSetupError(f"JetStream did not answer while setting up streams ({exc!r}); is JetStream enabled?", transient=True) from exc


async def _listed_models(js: JetStreamContext, subjects: Subjects) -> set[str]:
    """The models an existing models stream names one by one (a stream made before the
    wildcards); none for a new stream or one with the wildcards."""
    try:
        info = await js.stream_info(subjects.models_stream)
    except failures.NOT_FOUND:
        return set()
    names = set()
    for subject in info.config.subjects or []:
        queue = subjects.queue_from_subject(subject)
        if queue is None:
            continue
        try:
            names.add(validate_model_name(queue[0]))
        except ProtocolError:
            continue  # a wildcard
    return names


async def ensure_classifier_streams(
    js: JetStreamContext, subjects: Subjects, cfg: StreamsConfig, replies: RepliesConfig | None = None
) -> None:
    """Create or update the ingress, dead-letter and results streams and the classifier consumer."""
    try:
        await _ensure_stream(js, ingress_stream_config(subjects, cfg))
        await _ensure_stream(js, dead_letter_stream_config(subjects, cfg))
        if replies is not None and replies.durable:
            await _ensure_stream(js, results_stream_config(subjects, cfg, replies))
        await _ensure_consumer(js, subjects.ingress_stream, classifier_consumer_config(subjects, cfg))
    except failures.TIMEOUTS + failures.UNAVAILABLE as exc:
        raise StreamSetupError(f"JetStream did not answer while setting up streams ({exc!r}); is JetStream enabled?", transient=True) from exc


async def ensure_model_consumer(
    js: JetStreamContext, subjects: Subjects, cfg: StreamsConfig, model: str, priority: Priority | str = Priority.INTERACTIVE
) -> None:
    """Create or update the shared durable consumer for ``model``'s queue of class ``priority``."""
    await _ensure_consumer(js, subjects.models_stream, model_consumer_config(subjects, cfg, model, priority))


async def ensure_model_consumers(
    js: JetStreamContext,
    subjects: Subjects,
    cfg: StreamsConfig,
    models: Iterable[str],
    *,
    concurrency: int = 16,
    priorities: Iterable[Priority] = (Priority.INTERACTIVE,),
) -> None:
    """:func:`ensure_model_consumer` for many models (and ``priorities``' lines), ``concurrency``
    calls in flight: on a replicated stream each creation waits for a Raft group, and one at a
    time a thousand models took 67 s where 16 at a time take 9 s (docs/scaleout.md)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(model: str, priority: Priority) -> None:
        async with gate:
            await ensure_model_consumer(js, subjects, cfg, model, priority)

    await asyncio.gather(*(one(m, p) for m in models for p in priorities))


async def _ensure_consumer(js: JetStreamContext, stream: str, wanted: ConsumerConfig) -> None:
    for attempt in range(_SETUP_ATTEMPTS):
        try:
            # add_consumer on an existing durable with a compatible config updates it in place.
            await js.add_consumer(stream, wanted)
            return
        except failures.API_ERRORS + failures.TIMEOUTS as exc:
            if attempt == _SETUP_ATTEMPTS - 1:
                description = getattr(exc, "description", None) or repr(exc)
                raise StreamSetupError(
                    f"cannot create or update consumer {wanted.durable_name} on {stream}: {description}",
                    transient=not isinstance(exc, failures.API_ERRORS) or getattr(exc, "code", 0) in (500, 503),
                ) from exc
            # Concurrent creation by another replica, or a cluster electing a leader: retry.
            await asyncio.sleep(0.2 * (attempt + 1))
