"""Failover on a real 3-node NATS JetStream cluster: two worker processes, two equally busy
models, one nats-server node killed (SIGKILL) mid-traffic. Counts the model loads the placement
cost, the errors and lost requests, and the latency.

Settings are jetbatch's defaults (heartbeat 1 s, peer_timeout 5 s, poll 250 ms, ack_wait 30 s, no
max_wait_ms) except ``[streams] replicas = 3`` (and ``max_resident_models = 1``: one model per
worker). Each run gets a fresh cluster, a fresh deployment and its own prefix.

    python -m bench.reliability.failover --scenario node|leader --runs N [--json out.jsonl]

- ``node``: after ``--kill-at`` s (8) of traffic, kill one node chosen with a seeded RNG
  (``--seed`` + run index; recorded), down for the rest of the run.
- ``leader``: after ``--kill-at`` s, kill the node that leads the models stream
  (``<PREFIX>_MODELS``), down for the rest of the run.

Traffic: open loop, ``--rate`` req/s in total (100), fixed interval, alternating m1/m2, from one
SDK client, each ``infer_result(..., timeout=60)``, for ``--duration`` s (25). After the last
send the run waits ``--drain`` s (12) for answers; a request with no answer (no result, no error)
by then is *lost*. One JSON line per run, then a summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from jetbatch import sdk
from jetbatch.sdk.connection import connect_nats
from jetbatch.sdk.protocol import Subjects
from jetbatch.sidecar.percentiles import percentile
from jetbatch.sidecar.status import collect_status

from bench import harness

MODELS = ("m1", "m2")
LOAD_COST_S = 0.5
BATCH_COST_S = 0.005
ITEM_COST_S = 0.0002
# Worker log lines worth keeping per run (placement decisions and trouble).
KEEP = ("decided to load", "standing back", "not loading", "WARNING", "ERROR", "evict")


def write_config(directory: Path, prefix: str) -> Path:
    cost = {"load_cost_s": LOAD_COST_S, "batch_cost_s": BATCH_COST_S, "item_cost_s": ITEM_COST_S}
    model = {"handler": "sleep", "max_batch_size": 16, "max_delay_ms": 5, **cost, "options": cost}
    sections = {"nats": {"prefix": prefix}, "streams": {"replicas": 3}, "worker": {"max_resident_models": 1}, "models": dict.fromkeys(MODELS, model)}
    return harness.write_config(sections, directory, prefix)


async def reports(nc: Any, prefix: str, wait_s: float = 0.5) -> list[Any]:
    return [r for r in await collect_status(nc, Subjects(prefix), wait_s=wait_s) if r.role == "worker"]


def placement(reps: list[Any]) -> dict[str, list[str]]:
    return {r.id: sorted(r.resident) for r in reps}


async def leader_of(js: Any, stream: str) -> str | None:
    for _ in range(10):
        try:
            info = await js.stream_info(stream)
            return info.cluster.leader if info.cluster else None
        except Exception:  # noqa: BLE001 - an election in progress: ask again
            await asyncio.sleep(0.2)
    return None


async def traffic(cluster: Any, prefix: str, args: argparse.Namespace, run: int) -> dict[str, Any]:
    subjects = Subjects(prefix)
    out: dict[str, Any] = {}
    records: list[dict[str, Any]] = []
    tasks: list[asyncio.Task[None]] = []
    interval = 1.0 / args.rate
    async with sdk.Client.connect(cluster.url, prefix=prefix) as client:
        nc = await connect_nats(cluster.url)
        js = nc.jetstream(timeout=2)
        t0 = time.monotonic()

        async def one(i: int, model: str) -> None:
            rec: dict[str, Any] = {"i": i, "model": model, "sent": time.monotonic() - t0, "outcome": None, "rid": f"r{i:06d}"}
            records.append(rec)
            payload = f"{model}-{i}".encode()
            try:
                res = await client.infer_result(payload, model=model, timeout=60, request_id=rec["rid"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - typed jetbatch errors, counted by class
                rec["outcome"] = type(exc).__name__
                rec["message"] = str(exc)[:200]
                return
            ok = res.output == payload and res.batch.model == model
            rec.update(
                outcome="ok" if ok else "WrongAnswer",
                latency_ms=res.latency_s * 1000.0,
                worker=res.batch.worker,
                batch=res.batch.batch_id,
                loaded=res.batch.model_loaded,
                done=time.monotonic() - t0,
            )

        async def fault() -> None:
            await asyncio.sleep(max(0.0, t0 + args.kill_at - 0.6 - time.monotonic()))
            before = await reports(nc, prefix, wait_s=0.5)
            out["placement_before"] = placement(before)
            out["loads_before_kill"] = sum(r.stats.get("loads", 0) for r in before)
            models_leader = await leader_of(js, subjects.models_stream)
            kv_leader = await leader_of(js, f"KV_{subjects.kv_bucket}")
            names = [n.name for n in cluster.nodes]
            if args.scenario == "leader":
                victim = names.index(models_leader) if models_leader in names else 0
            else:
                victim = random.Random(args.seed + run).randrange(len(names))
            await asyncio.sleep(max(0.0, t0 + args.kill_at - time.monotonic()))
            out.update(
                victim=victim,
                victim_name=names[victim],
                models_leader=models_leader,
                kv_leader=kv_leader,
                victim_led_models=names[victim] == models_leader,
                victim_led_kv=names[victim] == kv_leader,
                kill_at_s=round(time.monotonic() - t0, 3),
                kill_wall=time.time(),
            )
            await asyncio.get_running_loop().run_in_executor(None, cluster.nodes[victim].kill)

        fault_task = asyncio.ensure_future(fault())
        n = int(args.duration * args.rate)
        for i in range(n):
            delay = t0 + i * interval - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(i, MODELS[i % len(MODELS)])))
        await fault_task
        done, pending = await asyncio.wait(tasks, timeout=args.drain)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        out["elapsed_s"] = round(time.monotonic() - t0, 2)
        # What became of each request still unanswered: its stored answer, and the queues' state.
        lost = [r for r in records if r["outcome"] is None]
        detail: list[dict[str, Any]] = []
        for r in lost:
            try:
                raw = await js.get_msg(subjects.results_stream, subject=subjects.result(r["rid"]), direct=True)
                stored = raw is not None
            except Exception:  # noqa: BLE001 - not stored, or the store unavailable
                stored = False
            detail.append({"rid": r["rid"], "model": r["model"], "sent": round(r["sent"], 3), "answer_stored": stored})
        try:
            info = await js.stream_info(subjects.models_stream, subjects_filter=subjects.models_wildcard)
            queued = dict(info.state.subjects or {})
        except Exception as exc:  # noqa: BLE001
            queued = {"error": repr(exc)}
        consumers = {}
        for m in MODELS:
            try:
                ci = await js.consumer_info(subjects.models_stream, f"model-{m}")
                consumers[m] = {"pending": ci.num_pending, "ack_pending": ci.num_ack_pending, "redelivered": ci.num_redelivered}
            except Exception as exc:  # noqa: BLE001
                consumers[m] = repr(exc)[:80]
        out["lost_detail"] = detail
        out["queues_at_end"] = {"stored": queued, "consumers": consumers}
        after = await reports(nc, prefix, wait_s=1.0)
        out["placement_after"] = placement(after)
        out["loads"] = sum(r.stats.get("loads", 0) for r in after)
        out["loads_per_worker"] = {r.id: r.stats.get("loads", 0) for r in after}
        out["workers_reporting"] = len(after)
        await nc.close()
    out["records"] = records
    return out


def summarize(run: int, scenario: str, raw: dict[str, Any]) -> dict[str, Any]:
    records = raw.pop("records")
    outcomes = Counter(r["outcome"] or "Lost" for r in records)
    lat = sorted(r["latency_ms"] for r in records if r["outcome"] == "ok")

    def pct(p: float) -> float | None:
        return round(percentile(lat, p), 1) if lat else None

    # Loads seen by the callers: distinct batches whose reply says the model was loaded for it.
    loaded_batches = {(r["worker"], r["batch"]) for r in records if r.get("loaded")}
    kill_at = raw.get("kill_at_s", 1e9)
    after_kill = [r for r in records if r["outcome"] == "ok" and r["done"] > kill_at + 1.0]
    served_after = sorted({(r["worker"][-8:], r["model"]) for r in after_kill})
    before, after_p = raw.get("placement_before", {}), raw.get("placement_after", {})
    swapped = any(before.get(w) and after_p.get(w) and before[w] != after_p[w] for w in before)
    errors = {k: v for k, v in outcomes.items() if k not in ("ok", "Lost")}
    slow = [r for r in records if r["outcome"] == "ok" and r["latency_ms"] > 2000]
    return {
        "run": run,
        "scenario": scenario,
        "sent": len(records),
        "ok": outcomes.get("ok", 0),
        "errors": errors,
        "lost": outcomes.get("Lost", 0),
        "lost_sent": [(round(r["sent"], 2), r["model"]) for r in records if r["outcome"] is None][:10],
        "loads": raw.get("loads"),
        "loads_before_kill": raw.get("loads_before_kill"),
        "loads_in_replies": len(loaded_batches),
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "max_ms": round(lat[-1], 1) if lat else None,
        "over_2s": len(slow),
        "over_2s_sent_s": [round(min(r["sent"] for r in slow), 1), round(max(r["sent"] for r in slow), 1)] if slow else None,
        "swapped": swapped,
        "placement_before": before,
        "placement_after": after_p,
        "served_after_kill": served_after,
        **{k: raw[k] for k in ("victim", "victim_name", "models_leader", "kv_leader", "victim_led_models", "victim_led_kv", "kill_at_s", "kill_wall", "elapsed_s", "workers_reporting", "loads_per_worker", "lost_detail", "queues_at_end") if k in raw},
        "error_samples": sorted({f"{r['outcome']}: {r.get('message', '')}" for r in records if r["outcome"] not in ("ok", None)})[:5],
    }


def one_run(run: int, args: argparse.Namespace, logs_dir: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="jetbatch-failover-"))
    prefix = f"fo{args.scenario[0]}{run}"
    config = write_config(work, prefix)
    started = time.monotonic()
    try:
        with (
            harness.cluster(3, base_dir=work / "cluster") as cluster,
            harness.processes(config, cluster.url, workers=2, classifier=False, log_level="INFO") as dep,
        ):
            raw = asyncio.run(traffic(cluster, prefix, args, run))
            kept: list[str] = []
            for name, path in sorted(dep._logs.items()):  # the logs a Deployment keeps
                dest = logs_dir / f"{args.scenario}-run{run}-{name}.log"
                shutil.copyfile(path, dest)
                kept += [f"{name}: {line}" for line in path.read_text(errors="replace").splitlines() if any(k in line for k in KEEP)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    row = summarize(run, args.scenario, raw)
    row["wall_s"] = round(time.monotonic() - started, 1)
    row["log_lines"] = kept[-40:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=("node", "leader"), required=True)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--json", help="append one JSON line per run (and the summary) here")
    parser.add_argument("--rate", type=float, default=100.0, help="requests/s in total, split over m1 and m2")
    parser.add_argument("--duration", type=float, default=25.0)
    parser.add_argument("--kill-at", type=float, default=8.0)
    parser.add_argument("--drain", type=float, default=12.0, help="s to wait for answers after the last send")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--logs-dir", default="/tmp/jetbatch-failover-logs")
    args = parser.parse_args()
    logs_dir = Path(args.logs_dir)
    logs_dir.mkdir(parents=True, exist_ok=True)
    sink = open(args.json, "a") if args.json else None
    rows = []
    for run in range(args.runs):
        row = one_run(run, args, logs_dir)
        rows.append(row)
        line = json.dumps(row)
        print(json.dumps({k: v for k, v in row.items() if k != "log_lines"}), flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()
    loads = [r["loads"] or 0 for r in rows]
    errors: Counter[str] = Counter()
    for r in rows:
        errors.update(r["errors"])
    summary = {
        "summary": args.scenario,
        "runs": len(rows),
        "loads_min": min(loads),
        "loads_median": statistics.median(loads),
        "loads_max": max(loads),
        "runs_over_4_loads": sum(1 for x in loads if x > 4),
        "runs_swapped": sum(1 for r in rows if r["swapped"]),
        "errors": dict(errors),
        "lost": sum(r["lost"] for r in rows),
        "p99_ms_max": max((r["p99_ms"] or 0) for r in rows),
    }
    print(json.dumps(summary), flush=True)
    if sink:
        sink.write(json.dumps(summary) + "\n")
        sink.close()


if __name__ == "__main__":
    main()
