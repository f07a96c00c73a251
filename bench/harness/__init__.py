"""What every benchmark scenario shares, in one place: scenarios import this package (and
``jetbatch``), never one another.

- :mod:`.servers`: :func:`server` / :func:`cluster`, an embedded nats-server with JetStream (or 3 nodes).
- :mod:`.configs`: :func:`config`, a :class:`Config` from sections under a fresh subject prefix
  (runs on one server never see each other's streams); :func:`write_config`, the one way a
  config becomes a TOML file for sidecars in processes of their own.
- :mod:`.sidecars`: :func:`in_process`, a worker (and a classifier) on this process's event loop;
  :func:`classifier_in_process`, a classifier alone; :func:`processes`, the sidecars as separate
  ``jetbatch`` processes (:class:`Deployment`, as ``jetbatch up`` runs them); :func:`cli_processes`,
  ``jetbatch`` roles under a wrapper of the scenario's (a profiler).
- :mod:`.load`: :func:`gather`, ``n`` calls at a concurrency timed as one burst; :func:`replay`,
  a trace's arrivals sent open-loop, each at its time.
- :mod:`.measure`: a process's CPU and memory, the workers' status counters.
- :mod:`.flooding`: :func:`start_flooder`, a raw client publishing one subject at full speed (a
  process of its own); :func:`open_loop`, a victim's calls at a fixed rate, their p99 and errors.
- :mod:`.simulated`: the simulator workloads scenarios share, and the live config of the same.
- :mod:`.raw`: the raw JetStream loop jetbatch is measured against; :mod:`.rounds`: raw and
  jetbatch rounds as deployed, each process's CPU a request; :mod:`.pprof`: nats-server's CPU
  profile read.
- :func:`emit` (:mod:`.records`): the run's record, printed and appended to ``--json``.

Scenarios live in groups by what they measure (``scheduler``, ``overhead``, ``scale``,
``reliability``, ``models``, ``peers``) and run as modules from the repository root:
``python -m bench.overhead.in_process ...``.
"""

from __future__ import annotations

from .configs import config, fresh_prefix, write_config
from .flooding import open_loop, slow_consumer_cuts, start_flooder
from .load import Gathered, Replayed, gather, replay
from .measure import cpu_s, cpu_split, rss_kib, worker_stats
from .records import emit
from .servers import cluster, server
from .sidecars import classifier_in_process, cli_processes, in_process, processes

__all__ = [
    "Gathered", "Replayed", "classifier_in_process", "cli_processes", "cluster", "config", "cpu_s", "cpu_split", "emit",
    "fresh_prefix", "gather", "in_process", "open_loop", "processes", "replay", "rss_kib", "server", "slow_consumer_cuts",
    "start_flooder",
    "worker_stats", "write_config",
]  # fmt: skip
