"""The scheduling simulator: workers serving shared model queues in simulated time, driving the
same policy core as the live worker (``sidecar/policy``). ``jetbatch simulate`` runs it."""

from .engine import simulate, simulate_policies
from .report import SimResult, lower_bound, plot, print_table
from .workloads import SimModel, Workload, WorkloadError, build_workload, capacity_rps, load_workload

__all__ = [
    "SimModel",
    "SimResult",
    "Workload",
    "WorkloadError",
    "build_workload",
    "capacity_rps",
    "load_workload",
    "lower_bound",
    "plot",
    "print_table",
    "simulate",
    "simulate_policies",
]
