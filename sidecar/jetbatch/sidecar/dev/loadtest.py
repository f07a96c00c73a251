"""``jetbatch bench``: load-test a deployment through the SDK, the way a user would.

Closed loop (``--concurrency C``: C callers, each sends its next request when the last returns) or
open loop (``--rate R``: Poisson arrivals at R requests/s, bounded in flight). The model mix
(``--mix m1=0.5,m2=0.5``; ``auto`` means "let the classifier decide") picks each request's model.
Without ``--nats-url`` it starts an embedded deployment: the given ``--config``, or a worker with
the ``sleep`` handler for every model of the mix.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import random
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jetbatch import sdk
from jetbatch.sdk.protocol import Tensor, validate_model_name

from ..percentiles import percentile

from ..errors import SidecarError

__all__ = ["BenchError", "BenchResult", "check_payload", "parse_mix", "plot_timeline", "print_table", "run_bench", "sleep_config"]


class BenchError(SidecarError, ValueError):
    pass


def parse_mix(text: str) -> dict[str, float]:
    """``m1=0.5,m2=0.3,auto=0.2`` → normalised weights (``auto``: no model, the classifier routes)."""
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, sep, weight = part.strip().partition("=")
        if not sep:
            raise BenchError(f"--mix: expected name=weight, got {part!r}")
        if name != "auto":
            try:
                validate_model_name(name)
            except ValueError as exc:
                raise BenchError(f"--mix: {exc}") from None
        try:
            w = float(weight)
        except ValueError:
            raise BenchError(f"--mix: weight of {name!r} is not a number: {weight!r}") from None
        if not math.isfinite(w):
            raise BenchError(f"--mix: weight of {name!r} is not a finite number: {weight!r}")
        if w < 0:
            raise BenchError(f"--mix: weight of {name!r} is negative")
        mix[name] = w
    total = sum(mix.values())
    if total <= 0:
        raise BenchError("--mix: weights sum to zero")
    return {k: v / total for k, v in mix.items()}


@dataclass
class BenchResult:
    sent: int = 0
    answered: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)
    timeline: list[tuple[float, float, str, str, bool]] = field(default_factory=list)  # (t, latency, model, batch, loaded)
    batches: dict[str, int] = field(default_factory=dict)
    loads: set[str] = field(default_factory=set)
    elapsed_s: float = 0.0
    # From the workers' counters over the run (None when no worker answered a status request):
    # loads by tier (a warm reload from host memory costs a fraction of a cold one) and the time
    # spent loading.
    loads_cold: int | None = None
    loads_warm: int | None = None
    load_s: float | None = None

    def summary(self) -> dict[str, Any]:
        def pct(q: float) -> float:
            return percentile(self.latencies_s, q / 100) * 1000

        return {
            "sent": self.sent,
            "answered": self.answered,
            "errors": dict(self.errors),
            "throughput_rps": self.answered / self.elapsed_s if self.elapsed_s else 0.0,
            "p50_ms": pct(50),
            "p95_ms": pct(95),
            "p99_ms": pct(99),
            "mean_batch_size": statistics.mean(self.batches.values()) if self.batches else 0.0,
            "batches": len(self.batches),
            "loads": len(self.loads),
            "loads_cold": self.loads_cold,
            "loads_warm": self.loads_warm,
            "load_s": self.load_s,
            "elapsed_s": self.elapsed_s,
        }


# Bounds of ``--payload``: the largest message a NATS server takes, and a tensor well under it.
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
MAX_TENSOR_DIM = 1024 * 1024


def check_payload(spec: str) -> tuple[str, int]:
    """``--payload``'s kind and size, checked before anything starts (:class:`BenchError`)."""
    kind, _, arg = spec.partition(":")
    limits = {"bytes": (0, MAX_PAYLOAD_BYTES, 256), "tensor": (1, MAX_TENSOR_DIM, 16)}
    if kind == "examples" and not arg:
        return kind, 0
    if kind not in limits:
        raise BenchError(f"--payload: expected bytes:N, tensor:DIM or examples, got {spec!r}")
    low, high, default = limits[kind]
    try:
        n = int(arg) if arg else default
    except ValueError:
        raise BenchError(f"--payload: {kind}:N takes a whole number, got {arg!r}") from None
    if not low <= n <= high:
        raise BenchError(f"--payload: {kind}:N must be {low} to {high}, got {n}")
    return kind, n


def _payload_factory(spec: str) -> Any:
    kind, n = check_payload(spec)
    if kind == "bytes":
        body = os.urandom(n)
        return lambda: body
    if kind == "tensor":
        import torch

        gen = torch.Generator().manual_seed(0)
        pool = [Tensor.from_torch(torch.randn(n, generator=gen)) for _ in range(64)]
        return lambda: random.choice(pool)
    from .example_models import sample_inputs  # examples: the demo's inputs

    x, _ = sample_inputs(256, seed=1)
    rows = [Tensor.from_torch(row) for row in x]
    return lambda: random.choice(rows)


async def run_bench(
    url: str,
    *,
    mix: dict[str, float],
    duration_s: float,
    concurrency: int | None = None,
    rate: float | None = None,
    payload: str = "bytes:256",
    timeout_s: float = 30.0,
    prefix: str = "jetbatch",
    progress: bool = False,
    seed: int = 0,
    result: BenchResult | None = None,
) -> BenchResult:
    """Drive the SDK for ``duration_s`` and collect what each reply says about its batch, and
    what the workers' counters say about loads. ``result``: filled as the run goes, so a caller
    that is interrupted still has what was measured."""
    rng = random.Random(seed)
    names = list(mix)
    weights = [mix[n] for n in names]
    make_payload = _payload_factory(payload)
    result = BenchResult() if result is None else result
    started = time.monotonic()
    deadline = started + duration_s

    async with sdk.Client.connect(url, prefix=prefix) as client:
        counted_before = await _load_counters(client)

        async def one() -> None:
            name = rng.choices(names, weights)[0]
            model = None if name == "auto" else name
            result.sent += 1
            try:
                r = await client.infer_result(make_payload(), model=model, timeout=timeout_s)
            except sdk.JetbatchError as exc:
                result.errors[exc.code] += 1
                return
            result.answered += 1
            result.latencies_s.append(r.latency_s)
            result.batches[r.batch.batch_id] = r.batch.batch_size
            if r.batch.model_loaded:
                result.loads.add(r.batch.batch_id)
            result.timeline.append((time.monotonic() - started, r.latency_s, r.batch.model, r.batch.batch_id, r.batch.model_loaded))

        async def closed_loop() -> None:
            while time.monotonic() < deadline:
                await one()

        # On a terminal a bar redrawn in place; piped or in CI (no terminal) a whole line now and
        # then, so a log shows the run is alive without filling with redraws.
        tty = sys.stderr.isatty()
        every_s = 0.5 if tty else max(1.0, min(10.0, duration_s / 10))

        async def reporter() -> None:
            while True:
                await asyncio.sleep(every_s)
                done = time.monotonic() - started
                counts = f"sent={result.sent} answered={result.answered} errors={sum(result.errors.values())}"
                if tty:
                    bar = "#" * int(30 * min(1.0, done / duration_s))
                    sys.stderr.write(f"\r[{bar:<30}] {done:5.1f}s {counts}")
                else:
                    sys.stderr.write(f"bench: {done:.1f}s of {duration_s:g}s {counts}\n")
                sys.stderr.flush()

        rep = asyncio.create_task(reporter()) if progress else None
        try:
            if concurrency is not None:
                await asyncio.gather(*(closed_loop() for _ in range(concurrency)))
            else:
                assert rate is not None
                tasks: set[asyncio.Task[None]] = set()
                next_at = time.monotonic()
                while next_at < deadline:
                    await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                    if len(tasks) < 20_000:  # bounded in flight: the generator must not eat the machine
                        t = asyncio.create_task(one())
                        tasks.add(t)
                        t.add_done_callback(tasks.discard)
                    next_at += rng.expovariate(rate)
                if tasks:
                    await asyncio.gather(*tasks)
        finally:
            result.elapsed_s = time.monotonic() - started
            if rep is not None:
                rep.cancel()
                if tty:
                    sys.stderr.write("\n")
        counted_after = await _load_counters(client)
        if counted_before is not None and counted_after is not None:
            result.loads_cold = counted_after["loads_cold"] - counted_before["loads_cold"]
            result.loads_warm = counted_after["loads_warm"] - counted_before["loads_warm"]
            result.load_s = (counted_after["load_us"] - counted_before["load_us"]) / 1e6
    return result


async def _load_counters(client: sdk.Client) -> dict[str, int] | None:
    """The workers' load counters summed (None when no worker answers a status request)."""
    from ..status import collect_status

    reports = [r for r in await collect_status(client.nats, client.subjects, wait_s=0.3) if r.role == "worker"]
    if not reports:
        return None
    return {key: sum(r.stats.get(key, 0) for r in reports) for key in ("loads_cold", "loads_warm", "load_us")}


def sleep_config(mix: dict[str, float], directory: Path) -> Path:
    lines = ["[worker]\nmax_resident_models = 1\n"]
    for name in mix:
        if name == "auto":
            raise BenchError("--mix auto=... needs a deployment with a classifier: pass --config (with a [classifier]) or --nats-url")
        lines.append(
            f'[models.{name}]\nhandler = "sleep"\nmax_batch_size = 32\nmax_delay_s = 0.005\nload_cost_s = 0.2\n'
            f"max_wait_s = 1.0\noptions = {{ load_cost_s = 0.2, batch_cost_s = 0.005, item_cost_s = 0.0002 }}\n"
        )
    path = directory / "bench-models.toml"
    path.write_text("\n".join(lines))
    return path


def print_table(s: dict[str, Any]) -> None:
    errors = ", ".join(f"{k}={v}" for k, v in sorted(s["errors"].items())) or "0"
    rows = [
        ("sent", s["sent"]), ("answered", s["answered"]), ("errors", errors),
        ("throughput", f"{s['throughput_rps']:.1f} req/s"),
        ("latency p50 / p95 / p99", f"{s['p50_ms']:.1f} / {s['p95_ms']:.1f} / {s['p99_ms']:.1f} ms"),
        ("mean batch size", f"{s['mean_batch_size']:.1f}"), ("batches", s["batches"]), ("loads", _loads(s)),
    ]  # fmt: skip
    if s.get("interrupted"):
        rows.insert(0, ("interrupted", f"after {s['elapsed_s']:.1f} s: what was measured until then"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def plot_timeline(result: BenchResult, path: str) -> None:
    """Latency of each request over time, and which model each batch served (loads marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({m for _, _, m, _, _ in result.timeline})
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    by_model: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for t, lat, m, _, _ in result.timeline:
        by_model[m].append((t, lat * 1000))
    for m in models:
        pts = by_model[m]
        ax1.scatter([p[0] for p in pts], [p[1] for p in pts], s=4, label=m)
    ax1.set_ylabel("latency (ms)")
    ax1.legend(loc="upper right", markerscale=3)
    ax1.set_title("jetbatch bench: latency and model residency")
    # One device: the model of each batch held it from the previous batch's completion to its own.
    first_reply: dict[str, tuple[float, str, bool]] = {}
    for t, _lat, m, batch, loaded in result.timeline:
        if batch not in first_reply or t < first_reply[batch][0]:
            first_reply[batch] = (t, m, loaded)
    previous_t = 0.0
    for t, m, loaded in sorted(first_reply.values()):
        y = models.index(m)
        ax2.plot([previous_t, t], [y, y], color="C%d" % y, linewidth=6, solid_capstyle="butt")
        if loaded:
            ax2.plot([previous_t], [y], marker="|", color="black", markersize=14)
        previous_t = t
    ax2.set_yticks(range(len(models)), models)
    ax2.set_xlabel("time (s)")
    ax2.set_ylabel("model (| = load)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _loads(s: dict[str, Any]) -> str:
    """Loads, split by tier with the time spent loading when the workers' counters were read."""
    if s.get("loads_cold") is None:
        return str(s["loads"])
    return f"{s['loads']} ({s['loads_cold']} cold from disk, {s['loads_warm']} warm from host memory; {s['load_s']:.2f} s loading)"
