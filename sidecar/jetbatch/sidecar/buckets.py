"""Opening the sidecars' key-value buckets: the workers' adverts, the attempts behind poison
verdicts, the model registry."""

from __future__ import annotations

from typing import Any

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType

from jetbatch.sdk import failures

__all__ = ["ensure_key_value"]


async def ensure_key_value(
    js: JetStreamContext, bucket: str, *, description: str, ttl_s: float, storage: StorageType, replicas: int, direct: bool = False
) -> Any:
    """Open the key-value ``bucket``, creating it (one value per key) if it does not exist yet;
    a peer creating it at the same moment is not an error. ``direct``: a key can be read with a
    direct get (from any replica, and with a permission narrowed to one subject)."""
    try:
        return await js.key_value(bucket)
    except failures.NOT_FOUND:
        try:
            return await js.create_key_value(
                KeyValueConfig(bucket=bucket, description=description, history=1, ttl=ttl_s, storage=storage, replicas=replicas, direct=direct)
            )
        except failures.BAD_REQUEST:
            return await js.key_value(bucket)  # created concurrently by a peer
