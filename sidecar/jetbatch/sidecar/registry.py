"""The model registry: each model a worker registers, a key of ``Subjects.registry_bucket``.

The models stream takes every model's subject through two wildcards, so its configuration (and
the server's work to create or update it) does not grow with the models. What its explicit
subject list also did, refusing a request for a model nobody serves, is this bucket's: producers
and the classifier look a model up before their first request to it (``jetbatch.sdk.registry``).
A worker writes the names missing from it before it reports ready, so its models are known as
soon as anyone may expect them served; names stay (as the old subject list's did), and a model
taken out of every worker's config is the orphan check's (``worker/orphans.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import StorageType

from jetbatch.sdk import failures
from jetbatch.sdk.protocol import Subjects, validate_model_name

from .buckets import ensure_key_value
from .config import StreamsConfig

__all__ = ["register_models", "registered_models"]

log = logging.getLogger("jetbatch.registry")

# Puts in flight at once when many names are new (10 000 models on a first start).
_PUTS_AT_ONCE = 256
# Passes over the missing names before a bucket without a leader is an error (about 9 s).
_ATTEMPTS = 10


async def _open(js: JetStreamContext, subjects: Subjects, cfg: StreamsConfig) -> Any:
    return await ensure_key_value(
        js,
        subjects.registry_bucket,
        description="jetbatch: the models the workers register, a key each",
        ttl_s=0,
        storage=StorageType.FILE,
        replicas=cfg.replicas,
        direct=True,
    )


async def registered_models(kv: Any) -> set[str]:
    """Every name in the registry (one ordered pass over its keys, whatever their number)."""
    try:
        return set(await kv.keys())
    except failures.NO_KEYS:
        return set()


async def _present(js: JetStreamContext, subjects: Subjects, kv: Any, wanted: int) -> set[str]:
    """The names the registry holds, read only when that is cheaper than writing ``wanted``
    names again: a worker registering 12 500 of 100 000 models writes its own (a put of a name
    already there only replaces it), rather than reading every other worker's too."""
    info = await js.stream_info(subjects.registry_stream)
    if info.state.messages > 2 * wanted:
        return set()
    return await registered_models(kv)


async def register_models(js: JetStreamContext, subjects: Subjects, cfg: StreamsConfig, names: Iterable[str]) -> int:
    """Write each of ``names`` the registry does not hold yet; returns how many were written."""
    wanted = {validate_model_name(name) for name in names}
    kv = await _open(js, subjects, cfg)
    if not wanted:
        return 0
    written = 0
    for attempt in range(_ATTEMPTS):
        try:
            missing = sorted(wanted - await _present(js, subjects, kv, len(wanted)))
            for start in range(0, len(missing), _PUTS_AT_ONCE):
                await asyncio.gather(*(kv.put(name, b"") for name in missing[start : start + _PUTS_AT_ONCE]))
                written += len(missing[start : start + _PUTS_AT_ONCE])
            break
        except failures.NO_STREAM + failures.UNAVAILABLE + failures.TIMEOUTS:
            # A bucket just made on a cluster has no leader for a moment: its puts find no
            # responder. What was written stays; the next pass writes what is still missing.
            if attempt == _ATTEMPTS - 1:
                raise
            await asyncio.sleep(0.2 * (attempt + 1))
    if written:
        log.info("wrote %d model names to %s", written, subjects.registry_bucket)
    return written
