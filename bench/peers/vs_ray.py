"""Ray Serve model multiplexing + dynamic batching on a jetbatch request trace.

The peer a user would pick instead of jetbatch for "many models, few resident, batch per model":
one Ray Serve deployment with ONE replica, `@serve.multiplexed(max_num_models_per_replica=R)` for
model loading and `@serve.batch(max_batch_size=B, batch_wait_timeout_s=D)` for batching. The
"model" is a stand-in with controlled costs, taken from the trace:

* load:  `time.sleep(load_cost_s)` inside the multiplexed loader. Blocking on purpose: a real load
  (unpickling weights, copying them to the device) holds the replica's thread, so nothing else on
  the replica runs meanwhile. `asyncio.sleep` would let other batches run during a load, which a
  real load does not allow. Every call of the loader is counted.
* batch: `time.sleep(batch_cost_s + n * item_cost_s)` for a batch of n items, blocking for the
  same reason (one device runs one batch at a time). `--sleep async` switches both to
  `asyncio.sleep` to see what overlap would buy; the default is `blocking`.

How multiplexing and batching are combined (what the Ray docs describe for this pairing): the
handle call carries `multiplexed_model_id`; `__call__` awaits the `@serve.batch` method; inside
the batch method `serve.get_multiplexed_model_id()` names the batch's model and the method awaits
the `@serve.multiplexed` loader for it. Ray's batcher takes up to `max_batch_size` queued requests
in arrival order (whatever their models) and then splits that batch into per-model sub-batches
(`ray/serve/batching.py`, `_split_batch_by_model_id`; documented on
`ray.serve.get_multiplexed_model_id`), so every call of the batch method sees one model. The
sub-batches of one batch run as concurrent asyncio tasks under one `max_concurrent_batches`
permit (default 1); with blocking sleeps they run one after another.

The replica's `max_ongoing_requests` is raised (default here 1000, `--max-ongoing`) from Ray's
default of 5, which would otherwise cap every batch at 5 requests and hold the rest in the
caller's router.

The client runs in this process: it sends each request open-loop at its trace time with
`handle.options(multiplexed_model_id=model).remote(x)`, waits for each answer until its
scheduled time + `timeout_s` (a request not answered by then counts as timed out and is
cancelled), and measures latency from the scheduled send time to the answer. Ray's startup is
not timed; one warm-up request (for the trace's first model) runs before the trace and is
excluded, together with the load it causes.

Imports only the standard library and ray (never jetbatch). Runs with its own virtualenv:

    python3 -m venv /work/ray-venv && /work/ray-venv/bin/pip install 'ray[serve]'
    /work/ray-venv/bin/python -m bench.peers.vs_ray --make-trace 200 40 60 1 /tmp/t200.json
    /work/ray-venv/bin/python -m bench.peers.vs_ray --trace /tmp/t200.json [--out result.json]

Output (stdout, and `--out` as JSON): system, ray_version, requests, answered, timed_out,
p50_s, p99_s, mean_s (over answered requests; nearest-rank percentiles), loads,
loads_per_request, wall_s (first scheduled send to last answer or deadline), plus a `details`
object (batch counts, send lag, settings).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from typing import Any

DEFAULTS = {
    "load_cost_s": 0.05,
    "batch_cost_s": 0.002,
    "item_cost_s": 0.0002,
    "max_batch_size": 16,
    "max_delay_s": 0.005,
    "max_resident_models": 2,
    "timeout_s": 60,
}


# --------------------------------------------------------------------------------------------
# Trace generation
# --------------------------------------------------------------------------------------------


def make_trace(n_models: int, rate: float, duration_s: float, seed: int) -> dict[str, Any]:
    """Poisson arrivals at `rate` req/s for `duration_s`; model of rank k (m{k-1}) has weight 1/k^1.1."""
    rng = random.Random(seed)
    models = [f"m{i}" for i in range(n_models)]
    weights = [1.0 / (k**1.1) for k in range(1, n_models + 1)]
    cum = []
    total = 0.0
    for w in weights:
        total += w
        cum.append(total)
    arrivals: list[list[Any]] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            break
        model = rng.choices(models, cum_weights=cum, k=1)[0]
        arrivals.append([round(t, 6), model])
    return {"models": models, "arrivals": arrivals, **DEFAULTS}


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def nearest_rank(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile: sorted list, index ceil(q*n)-1."""
    n = len(sorted_values)
    if n == 0:
        return None
    return sorted_values[max(0, math.ceil(q * n) - 1)]


def build_app(trace: dict[str, Any], sleep_mode: str, max_ongoing: int):
    from ray import serve

    load_cost = float(trace["load_cost_s"])
    batch_cost = float(trace["batch_cost_s"])
    item_cost = float(trace["item_cost_s"])
    max_batch = int(trace["max_batch_size"])
    max_delay = float(trace["max_delay_s"])
    resident = int(trace["max_resident_models"])
    blocking = sleep_mode == "blocking"

    @serve.deployment(num_replicas=1, max_ongoing_requests=max_ongoing)
    class MultiModel:
        def __init__(self) -> None:
            self.loads = 0
            self.batches = 0
            self.batched_items = 0
            self.largest_batch = 0

        @serve.multiplexed(max_num_models_per_replica=resident)
        async def get_model(self, model_id: str) -> dict[str, str]:
            self.loads += 1
            if blocking:
                time.sleep(load_cost)
            else:
                await asyncio.sleep(load_cost)
            return {"id": model_id}

        @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=max_delay)
        async def predict(self, xs: list[Any]) -> list[Any]:
            model_id = serve.get_multiplexed_model_id()
            model = await self.get_model(model_id)
            n = len(xs)
            self.batches += 1
            self.batched_items += n
            self.largest_batch = max(self.largest_batch, n)
            cost = batch_cost + n * item_cost
            if blocking:
                time.sleep(cost)
            else:
                await asyncio.sleep(cost)
            return [[model["id"], x] for x in xs]

        async def __call__(self, x: Any) -> Any:
            return await self.predict(x)

        def stats(self) -> dict[str, int]:
            return {
                "loads": self.loads,
                "batches": self.batches,
                "batched_items": self.batched_items,
                "largest_batch": self.largest_batch,
            }

    return MultiModel.bind()


async def drive(handle: Any, trace: dict[str, Any]) -> dict[str, Any]:
    arrivals = trace["arrivals"]
    timeout_s = float(trace["timeout_s"])
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    timed_out = 0
    errors: list[str] = []
    wrong = 0
    send_lag_max = 0.0
    send_lag_sum = 0.0
    last_done = 0.0

    async def one(i: int, sched: float, model: str) -> None:
        nonlocal timed_out, wrong, last_done
        resp = handle.options(multiplexed_model_id=model).remote(i)
        remaining = sched + timeout_s - loop.time()
        try:
            out = await asyncio.wait_for(resp, timeout=max(0.0, remaining))
        except TimeoutError:
            timed_out += 1
            last_done = max(last_done, loop.time())
            return
        except Exception as e:  # noqa: BLE001 - count and report, keep the run going
            errors.append(f"{type(e).__name__}: {e}"[:300])
            last_done = max(last_done, loop.time())
            return
        done = loop.time()
        last_done = max(last_done, done)
        if out != [model, i]:
            wrong += 1
        latencies.append(done - sched)

    tasks = []
    t0 = loop.time() + 0.5
    for i, (t, model) in enumerate(arrivals):
        sched = t0 + float(t)
        delay = sched - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = loop.time() - sched
        send_lag_max = max(send_lag_max, lag)
        send_lag_sum += lag
        tasks.append(asyncio.create_task(one(i, sched, model)))
    await asyncio.gather(*tasks)
    first = t0 + float(arrivals[0][0]) if arrivals else t0
    return {
        "latencies": latencies,
        "timed_out": timed_out,
        "errors": errors,
        "wrong_answers": wrong,
        "send_lag_max_s": send_lag_max,
        "send_lag_mean_s": send_lag_sum / max(1, len(arrivals)),
        "wall_s": max(0.0, last_done - first),
    }


def run_trace(trace: dict[str, Any], sleep_mode: str, max_ongoing: int) -> dict[str, Any]:
    for key, value in DEFAULTS.items():
        trace.setdefault(key, value)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    t_start = time.perf_counter()
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    serve.start(proxy_location="Disabled")
    handle = serve.run(build_app(trace, sleep_mode, max_ongoing), name="vs_ray", route_prefix=None)
    warm_model = trace["arrivals"][0][1] if trace["arrivals"] else trace["models"][0]
    t_w = time.perf_counter()
    handle.options(multiplexed_model_id=warm_model).remote(-1).result(timeout_s=120)
    warmup_s = time.perf_counter() - t_w
    startup_s = time.perf_counter() - t_start
    before = handle.stats.remote().result(timeout_s=60)

    got = asyncio.run(drive(handle, trace))

    after = handle.stats.remote().result(timeout_s=120)
    serve.shutdown()
    ray.shutdown()

    n = len(trace["arrivals"])
    lat = sorted(got["latencies"])
    loads = after["loads"] - before["loads"]
    batches = after["batches"] - before["batches"]
    items = after["batched_items"] - before["batched_items"]
    return {
        "system": "ray-serve",
        "ray_version": ray.__version__,
        "requests": n,
        "answered": len(lat),
        "timed_out": got["timed_out"],
        "p50_s": nearest_rank(lat, 0.50),
        "p99_s": nearest_rank(lat, 0.99),
        "mean_s": (sum(lat) / len(lat)) if lat else None,
        "loads": loads,
        "loads_per_request": loads / n if n else None,
        "wall_s": got["wall_s"],
        "details": {
            "errors": len(got["errors"]),
            "first_errors": got["errors"][:3],
            "wrong_answers": got["wrong_answers"],
            # One call of the @serve.batch method = one single-model sub-batch (Ray splits each
            # arrival-order batch of up to max_batch_size by multiplexed_model_id).
            "model_sub_batches": batches,
            "mean_sub_batch_size": items / batches if batches else None,
            "largest_sub_batch": after["largest_batch"],
            "send_lag_max_s": got["send_lag_max_s"],
            "send_lag_mean_s": got["send_lag_mean_s"],
            "startup_s": startup_s,
            "warmup_request_s": warmup_s,
            "warmup_model": warm_model,
            "sleep_mode": sleep_mode,
            "max_ongoing_requests": max_ongoing,
            "trace_params": {k: trace[k] for k in DEFAULTS},
            "n_models": len(trace["models"]),
            "python": sys.version.split()[0],
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", help="trace JSON to replay against Ray Serve")
    ap.add_argument("--out", help="write the result JSON here too")
    ap.add_argument(
        "--make-trace",
        nargs=5,
        metavar=("N_MODELS", "RATE", "DURATION_S", "SEED", "OUT_JSON"),
        help="write a Poisson/Zipf(1.1) trace and exit",
    )
    ap.add_argument("--sleep", choices=("blocking", "async"), default="blocking",
                    help="how the stand-in model spends its load and batch costs (default blocking)")
    ap.add_argument("--max-ongoing", type=int, default=1000,
                    help="the replica's max_ongoing_requests (Ray's default is 5)")
    args = ap.parse_args()

    if args.make_trace:
        n_models, rate, duration, seed, out = args.make_trace
        trace = make_trace(int(n_models), float(rate), float(duration), int(seed))
        with open(out, "w") as f:
            json.dump(trace, f)
        print(f"wrote {out}: {len(trace['arrivals'])} arrivals over {duration} s, {n_models} models")
        return
    if not args.trace:
        ap.error("give --trace TRACE.json or --make-trace ...")
    with open(args.trace) as f:
        trace = json.load(f)
    result = run_trace(trace, args.sleep, args.max_ongoing)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
