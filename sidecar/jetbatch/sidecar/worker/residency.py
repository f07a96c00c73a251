"""Residency: which models are on the device, which are warm in host memory, and the moves
between the tiers (load, evict, prefetch), measured.

Tiers: *cold* (on disk), *warm* (weights in host memory, pinned for CUDA), *resident* (on the
device). An evicted model stays warm when the host budget (``host_memory_budget_bytes``) has
room, after dropping the warm copies worth least (reload cost × demand, the rule the scheduler
uses for the device); reading the next model's weights ahead (prefetch) moves it into the warm
tier while another model computes. Every load is timed and its cost recorded for the tier it came
from, so the scheduler sees the cost that matches each model's current tier.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any, Awaitable, Callable, Iterable, Sequence

import anyio
import anyio.abc

from ..handlers import HandlerError
from ..core import Evicted, Loaded, Warmed, WorkerCore
from ..policy import Tier, fits_host, prefetch_choice, reload_tier, warm_copy_value
from ..telemetry import LoadRecord, WorkerTelemetry
from .slots import Slot
from .counters import Counters

__all__ = ["Residency", "default_host_budget_bytes"]

log = logging.getLogger("jetbatch.worker")


def default_host_budget_bytes() -> int:
    """A quarter of the machine's physical memory."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4)
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 4 * 1024**3


def _is_oom(exc: BaseException) -> bool:
    import torch

    oom = getattr(torch, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()


class Residency:
    def __init__(
        self,
        *,
        slots: dict[str, Slot],
        device: Any,
        core: WorkerCore,
        telemetry: WorkerTelemetry,
        device_lock: anyio.Lock,
        host_budget_bytes: int,
        prefetch: bool,
        counters: Counters,
        on_load_failed: Callable[[Slot, str], Awaitable[None]],
    ) -> None:
        self.slots = slots
        self.device = device
        self.core = core  # told of every load, eviction and prefetch
        self.costs = core.costs  # read: estimates of load costs and memory
        self.telemetry = telemetry
        self.device_lock = device_lock
        self.host_budget_bytes = host_budget_bytes
        self.prefetch_enabled = prefetch
        self._counters = counters
        self.on_load_failed = on_load_failed
        self.loading: str | None = None
        self._prefetching: set[str] = set()
        # Models warm or resident: what the host-budget sums walk (not every registered model).
        self._held: set[str] = {n for n, s in slots.items() if s.tier != "cold"}
        # Of those, the models on the device: asked for several times a turn, and with an
        # unbounded warm tier the held models grow toward every registered one.
        self._resident: set[str] = {n for n in self._held if slots[n].resident}
        self._host_used: int | None = None
        # Models that cannot load, and why (``Slot.broken``, set only here): what the report
        # lists without walking every registered model each heartbeat.
        self.broken: dict[str, str] = {}

    # --- what the scheduler is told ---------------------------------------------------------------

    def reload_fits_host(self, slot: Slot) -> bool:
        """For a resident model: whether, evicted now, the host tier would keep its weights (a
        warm reload). Asked only of resident models: the sums walk only warm ones."""
        return slot.resident and self._fits_host(slot, self._host_bytes(slot))

    def load_cost_s(self, slot: Slot) -> float:
        """For a model not on the device: the cost of loading it from its tier. For a resident
        one: the cost of loading it back if it were evicted now, which is what evicting it
        would cost (``policy.reload_tier``, the simulator's rule too)."""
        return self.costs.load_cost_s(slot.name, reload_tier(slot.tier, self.reload_fits_host(slot)))

    def measured_load_s(self, slot: Slot) -> float | None:
        """What :meth:`load_cost_s` estimates, when a load of this model from that tier was
        measured here; None while the figure is only the configured guess."""
        return self.costs.measured_load_s(slot.name, reload_tier(slot.tier, self.reload_fits_host(slot)))

    def host_used_bytes(self) -> int:
        """Host bytes of the warm tier (remembered until a model changes tier: the decisions ask
        for it once per resident model)."""
        if self._host_used is None:
            cuda = getattr(self.device, "type", "cpu") == "cuda"
            held = (self.slots[n] for n in self._held)
            self._host_used = sum(s.handler.host_bytes() for s in held if s.tier == "warm" or (cuda and s.resident and s.handler.warm))
        return self._host_used

    def held_names(self) -> list[str]:
        """The models warm or on the device."""
        return sorted(self._held)

    def resident_names(self) -> list[str]:
        """The models on the device."""
        return sorted(self._resident)

    def _set_tier(self, slot: Slot, tier: Tier) -> None:
        slot.place.tier = tier
        self._host_used = None
        if tier == "cold":
            self._held.discard(slot.name)
        else:
            self._held.add(slot.name)
        if tier == "resident":
            self._resident.add(slot.name)
        else:
            self._resident.discard(slot.name)

    def check_models(self) -> None:
        """Report a model that cannot load (a missing file) now, in one line, not at its first request."""
        for slot in self.slots.values():
            try:
                slot.handler.check()
            except HandlerError as exc:
                self._set_broken(slot, exc.reason(slot.name))
                log.error("%s: its requests will get model_failed until it can load", exc.detail)

    def _set_broken(self, slot: Slot, reason: str | None) -> None:
        slot.place.broken = reason
        if reason is None:
            self.broken.pop(slot.name, None)
        else:
            self.broken[slot.name] = reason

    def announce_loading(self, name: str | None) -> None:
        """``name`` is being loaded (a claim won, before the load: peers count our drain), or
        nothing is (the load ended, or was given up)."""
        self.loading = name

    def first_batch(self, slot: Slot) -> tuple[bool, LoadRecord | None]:
        """For the batch about to run on ``slot``: whether it is the first since the load (it
        "paid" it), and the load's record to report under it (once)."""
        fresh, record = slot.place.fresh_load, slot.place.pending_load
        slot.place.fresh_load, slot.place.pending_load = False, None
        return fresh, record if fresh else None

    # --- moves ----------------------------------------------------------------------------------

    async def load(self, slot: Slot, evict: Sequence[str], *, reason: str) -> bool:
        """Evict ``evict`` (in order), then make ``slot`` resident. False if it could not load:
        its waiting requests were then answered ``model_failed``. The core is told (``Loaded``,
        ``Evicted``); it knows the backlog share the load owes."""
        if slot.broken is not None:
            try:
                slot.handler.check()  # the file may have appeared since startup
                self._set_broken(slot, None)
            except HandlerError as exc:
                self._set_broken(slot, exc.reason(slot.name))
                await self.on_load_failed(slot, str(exc))
                return False
        # Wait outside the device lock: the victims' in-flight batches need it to finish.
        for name in evict:
            victim = self.slots[name]
            await victim.wait_model_free(self.core)
        self.loading = slot.name
        try:
            async with self.device_lock:
                unloads: list[tuple[Any, ...]] = []
                for name in evict:
                    unloads.append(await self._evict(self.slots[name]))
                if slot.resident:
                    return True
                return await self._load_locked(slot, evict, unloads, reason)
        finally:
            self.loading = None

    async def _load_locked(
        self, slot: Slot, evict: Sequence[str], unloads: list[tuple[Any, ...]], reason: str
    ) -> bool:
        tier = slot.tier
        started = time.perf_counter()
        started_ns = time.time_ns()
        before = _device_bytes(self.device)
        error: BaseException | None = None
        for attempt in range(2):
            try:
                await anyio.to_thread.run_sync(slot.handler.load, self.device)
                error = None
                break
            except Exception as exc:  # noqa: BLE001 - a model that cannot load must not stop the worker
                error = exc
                if attempt == 0 and _is_oom(exc):
                    # Out of memory: make room (every other resident model, idle under the device
                    # lock) and try once more.
                    log.warning("loading %s ran out of memory; evicting the other resident models and retrying", slot.name)
                    for other in [s for s in self.slots.values() if s.resident and s is not slot and not s.config.pin]:
                        unloads.append(await self._evict(other))
                    await anyio.to_thread.run_sync(_collect, self.device)
                    continue
                break
        if error is not None:
            why = error.reason(slot.name) if isinstance(error, HandlerError) else _one_line(error)
            message = f"model {slot.name} failed to load: {'out of memory: ' if _is_oom(error) else ''}{why}"
            with self.telemetry.child_span("model.load", **{"jetbatch.model": slot.name}) as span:
                self.telemetry.mark_error(span, error)
            log.error("%s", error.detail if isinstance(error, HandlerError) else message)
            self._set_tier(slot, "warm" if slot.handler.warm else "cold")
            await self.on_load_failed(slot, message)
            return False
        seconds = time.perf_counter() - started
        # Measured: the handler's own count (parameters and buffers, or the CUDA allocator delta
        # around its load), else the allocator delta seen from here.
        memory = slot.handler.memory_bytes() or max(0, _device_bytes(self.device) - before)
        slot.place.pending_load = LoadRecord(slot.name, started_ns, time.time_ns(), memory, tuple(evict), unloads)
        self._set_tier(slot, "resident")
        slot.place.fresh_load = True
        self.core.handle(Loaded(slot.name, tier, seconds, time.time(), slot.backlog, memory_bytes=memory, host_bytes=slot.handler.host_bytes()))
        self._counters.add("loads")
        self._counters.add(f"loads_{tier}")  # from the host's warm copy, or cold from disk
        self._counters.add("load_us", int(seconds * 1e6))
        attrs = {"jetbatch.model": slot.name, "jetbatch.model.tier": tier}
        self.telemetry.loads.add(1, attrs)
        self.telemetry.load_duration.record(seconds, attrs)
        self.telemetry.switches.add(1, {"jetbatch.reason": reason})
        log.info("loaded %s from %s in %.3fs (%s bytes), evicted %s", slot.name, tier, seconds, memory, list(evict) or "none")
        self._enforce_host_budget(keep=slot)
        return True

    async def _evict(self, victim: Slot) -> tuple[Any, ...]:
        """Resident → warm when the host tier has room for it, else → cold."""
        started_ns = time.time_ns()
        started = time.perf_counter()
        memory = self.costs.memory_bytes(victim.name)
        keep_warm = victim.handler.warm and self._fits_host(victim, self._host_bytes(victim))
        if keep_warm:
            self._make_host_room(self._host_bytes(victim), keep=victim)
            await anyio.to_thread.run_sync(victim.handler.offload)
        else:
            await anyio.to_thread.run_sync(victim.handler.unload)
        if getattr(self.device, "type", "cpu") == "cuda":
            # Reference cycles can pin device memory until a collection; on the CPU the refcount
            # drop frees it, and a full collection would cost ~0.1 s per switch.
            await anyio.to_thread.run_sync(_collect, self.device)
        self._set_tier(victim, "warm" if keep_warm and victim.handler.warm else "cold")
        victim.place.pending_load = None
        victim.place.fresh_load = False
        self.core.handle(Evicted(victim.name, time.time()))
        self._counters.add("evictions")
        self.telemetry.evictions.add(1, {"jetbatch.model": victim.name, "jetbatch.model.tier": victim.tier})
        self.telemetry.unload_duration.record(time.perf_counter() - started, {"jetbatch.model": victim.name})
        return (victim.name, started_ns, time.time_ns(), memory)

    async def evict(self, slot: Slot, *, reason: str) -> bool:
        """Evict one resident model on its own (an idle unload): to the warm tier where it fits,
        once its in-flight batches no longer need it. False if it was no longer resident."""
        await slot.wait_model_free(self.core)
        async with self.device_lock:
            if not slot.resident or self.core.in_flight(slot.name):
                return False
            await self._evict(slot)
        log.info("evicted %s (%s), now %s", slot.name, reason, slot.tier)
        return True

    async def unload_all(self) -> None:
        for slot in [self.slots[n] for n in sorted(self._held)]:
            if slot.resident or slot.tier == "warm":
                try:
                    await anyio.to_thread.run_sync(slot.handler.unload)
                except Exception as exc:  # noqa: BLE001 - shutting down: log and go on
                    log.warning("unloading %s failed: %r", slot.name, exc)
                self._set_tier(slot, "cold")

    def prefetch(
        self, tg: anyio.abc.TaskGroup, *, exclude: str, backlog_of: Callable[[Slot], int], candidates: Iterable[str]
    ) -> None:
        """Read the likely next model's weights into the warm tier while the device computes, so
        a switch pays only the host-to-device copy. ``candidates``: the models with requests
        waiting; ``backlog_of``: the backlog that is ours to serve (a model other workers
        already drain is not worth a read)."""
        if not self.prefetch_enabled or self.host_budget_bytes <= 0:
            return
        cold = [self.slots[n] for n in candidates if n in self.slots]
        choice = prefetch_choice((s.name, backlog_of(s)) for s in cold if s.tier == "cold" and s.name != exclude and s.broken is None)
        if choice is None:
            return
        nxt = self.slots[choice]
        if nxt.name in self._prefetching or not self._fits_host(nxt, self.costs.host_memory_bytes(nxt.name)):
            return
        self._prefetching.add(nxt.name)

        async def read() -> None:
            try:
                self._make_host_room(self.costs.host_memory_bytes(nxt.name), keep=nxt)
                await anyio.to_thread.run_sync(nxt.handler.read_weights)
                self._host_used = None
                if nxt.tier == "cold" and nxt.handler.warm:
                    self._set_tier(nxt, "warm")
                    self.core.handle(Warmed(nxt.name, nxt.handler.host_bytes()))
            except Exception as exc:  # noqa: BLE001 - the real load reports the error
                log.debug("prefetch of %s failed: %r", nxt.name, exc)
            finally:
                self._prefetching.discard(nxt.name)

        tg.start_soon(read)

    # --- the host budget ------------------------------------------------------------------------

    def _host_bytes(self, slot: Slot) -> int:
        return slot.handler.host_bytes() or self.costs.host_memory_bytes(slot.name)

    def _value(self, slot: Slot, now: float) -> float:
        """What keeping ``slot`` warm is worth: its cold reload cost × its likely demand."""
        recent = self.core.driver.demand(slot.name, now)
        return warm_copy_value(self.costs.load_cost_s(slot.name, "cold"), slot.backlog, recent)

    def _fits_host(self, slot: Slot, nbytes: int) -> bool:
        """Whether ``nbytes`` of ``slot`` fit the host budget once warm copies worth less go."""
        if self.host_budget_bytes <= 0 or nbytes > self.host_budget_bytes:
            return False
        used = self.host_used_bytes() - (self._host_bytes(slot) if slot.tier == "warm" else 0)
        if used + nbytes <= self.host_budget_bytes:
            return True  # fits as it is: no warm copy need be weighed (the common case, and O(1) decisions)
        now = time.time()
        warm = [self.slots[n] for n in self._held if self.slots[n].tier == "warm" and self.slots[n] is not slot]
        others = ((self._host_bytes(s), self._value(s, now)) for s in warm)
        return fits_host(self.host_budget_bytes, nbytes, used, others, self._value(slot, now))  # the simulator's rule too

    def _make_host_room(self, nbytes: int, *, keep: Slot) -> None:
        now = time.time()
        while self.host_used_bytes() - (self._host_bytes(keep) if keep.tier == "warm" else 0) + nbytes > self.host_budget_bytes:
            warm = [self.slots[n] for n in sorted(self._held) if self.slots[n].tier == "warm" and self.slots[n] is not keep]
            if not warm:
                return
            victim = min(warm, key=lambda s: (self._value(s, now), s.name))
            victim.handler.drop_host_copy()
            self._host_used = None
            self._set_tier(victim, "cold")
            log.info("dropped the warm copy of %s (host memory budget)", victim.name)

    def _enforce_host_budget(self, *, keep: Slot) -> None:
        if self.host_used_bytes() > self.host_budget_bytes:
            self._make_host_room(0, keep=keep)


def _collect(device: Any) -> None:
    gc.collect()
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.empty_cache()


def _device_bytes(device: Any) -> int:
    if getattr(device, "type", "cpu") != "cuda":
        return 0
    try:
        import torch

        return int(torch.cuda.memory_allocated(device))
    except Exception:  # noqa: BLE001
        return 0


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:300]
