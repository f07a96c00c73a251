"""The worker core: one worker's state and every rule it decides by, with no I/O and no clock.

- :mod:`.events`: what the core is told (a turn's facts, batches fetched, computed, settled and done, loads, evictions).
- :mod:`.actions`: what it asks its executor to do (fetch, hold, load, unload, recount, wait, sleep...).
- :mod:`.turns`: :class:`WorkerCore`, the rules.

The live worker (``sidecar/worker``) and the simulator (``sidecar/simulator``) are its two
executors (docs/architecture.md); ``sidecar/recording.py`` records a core and replays it.
"""

from .actions import Action, Fetch, Hold, LoadModel, Proceed, Reap, Recount, Sleep, Unload, WaitFree, WaitRoom
from .events import BatchChecked, BatchDone, ClaimLost, Computed, Event, Evicted, Fetched, LoadDue, Loaded, ModelRules, Settled, Started, Turn, Warmed
from .turns import Recorder, WorkerCore

__all__ = [
    "Action",
    "BatchChecked",
    "BatchDone",
    "ClaimLost",
    "Computed",
    "Event",
    "Evicted",
    "Fetch",
    "Fetched",
    "Hold",
    "LoadDue",
    "LoadModel",
    "Loaded",
    "ModelRules",
    "Proceed",
    "Reap",
    "Recorder",
    "Recount",
    "Settled",
    "Sleep",
    "Started",
    "Turn",
    "Unload",
    "WaitFree",
    "WaitRoom",
    "Warmed",
    "WorkerCore",
]
