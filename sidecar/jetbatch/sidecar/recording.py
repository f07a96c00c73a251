"""The flight recorder and exact replay of a worker core.

**Recording.** A worker core's events and actions as JSON lines, bounded in size. Line 1 is the
core's :class:`~.core.Started` (policy, models, budget); each later line is one event handed to
the core and the action it answered (``null`` for none):
``{"event": {"type": "turn", ...}, "action": {"type": "fetch", ...}}``. Past ``max_bytes`` the
recorder writes one ``{"truncated": true}`` line and stops: a replay checks what came before (a
recording can only be replayed from its start, where the core's state is known). Writes go to a
buffered file on the caller's thread: a line is a few hundred bytes to a few KiB (a turn lists
the facts of the models its decision looks at), written out in blocks, so recording costs the
serving loop a memory copy per event, not a system call.

**Replay.** A fresh core is made from the recording's first line and handed every recorded event
in order; each action it answers must equal the recorded one. This holds by construction: every
rule a worker decides by lives in the core (``core/turns.py``), which reads no clock and does no
I/O; whatever it reads comes in an event, and the recorder keeps every event. A divergence means
the code that decides changed (a new release reading an old recording) or something fed the
core outside ``handle``.
"""

from __future__ import annotations

import io
import math
import os
import time
from typing import IO, Any, Callable, Iterable, Iterator

import msgspec

from .core import Action, Event, Started, WorkerCore
from .errors import SidecarError

__all__ = [
    "DEFAULT_MAX_BYTES", "Divergence", "FlightRecorder", "RecordLine", "Recorders", "RecordingError", "ReplayResult", "RingRecorder", "replay",
    "replay_file",
]  # fmt: skip

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
_BUFFER_BYTES = 1024 * 1024


class RecordLine(msgspec.Struct, frozen=True, omit_defaults=True):
    """One recorded step: the event, the action it produced (None: none), the end marker, or
    (second in a ring's dump) the core's state the events after it start from."""

    event: Event | None = None
    action: Action | None = None
    truncated: bool = False
    snapshot: dict[str, Any] | None = None  # the core's state as JSON data (``WorkerCore.export_state``)


class RingRecorder:
    """The last minutes of a core's events, kept in memory and written out on demand
    (``jetbatch worker --ring-minutes N --ring-path PATH``: on SIGUSR1).

    Every ``window_s`` it takes a snapshot of the core's state (``WorkerCore.export_state``) and
    starts a new segment; it keeps the segment before as well, so a dump spans between one and
    two windows. :meth:`dump` writes the core's started line, the older segment's snapshot and
    the events since it: a recording that replays from the snapshot (:func:`replay`). ``attach``
    gives it the core (the core writes its started line before it can be attached)."""

    def __init__(self, window_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not window_s > 0:
            raise ValueError("a ring needs a window longer than 0 s")
        self.window_s = window_s
        self._clock = clock
        self._encoder = msgspec.json.Encoder()
        self._core: WorkerCore | None = None
        self._started: bytes | None = None
        self._segments: list[tuple[bytes, list[bytes]]] = []  # (snapshot line, event lines), oldest first
        self._next_snapshot = math.inf

    def attach(self, core: WorkerCore) -> None:
        self._core = core
        self._snapshot()

    def write(self, event: Event, action: Action | None) -> None:
        line = self._encoder.encode(RecordLine(event=event, action=action))
        if isinstance(event, Started):
            self._started = line
            return
        if not self._segments:
            return  # not attached yet: nothing to start a replay from
        self._segments[-1][1].append(line)
        if self._clock() >= self._next_snapshot:
            self._snapshot()  # after this event: the next segment starts from the state it left

    def _snapshot(self) -> None:
        assert self._core is not None
        line = self._encoder.encode(RecordLine(snapshot=self._core.export_state()))
        self._segments = [*self._segments[-1:], (line, [])]
        self._next_snapshot = self._clock() + self.window_s

    def lines(self) -> list[bytes]:
        """The kept recording, a line each (no newlines): the started line, the snapshot, the
        events since it. Taken between two events (on the thread that records), so whole."""
        if self._started is None or not self._segments:
            raise RecordingError("nothing recorded yet")
        snapshot, _ = self._segments[0]
        return [self._started, snapshot, *(line for _, lines in self._segments for line in lines)]

    def dump(self, path: str | os.PathLike[str]) -> int:
        """Write the kept events as a recording at ``path`` (replaced whole); how many events."""
        lines = self.lines()
        tmp = f"{os.fspath(path)}.part"
        with open(tmp, "wb") as f:
            f.writelines(line + b"\n" for line in lines)
        os.replace(tmp, path)  # a reader never sees half a dump
        return len(lines) - 2


class Recorders:
    """Several recorders of one core (a file and a ring)."""

    def __init__(self, *recorders: Any) -> None:
        self.recorders = recorders

    def write(self, event: Event, action: Action | None) -> None:
        for r in self.recorders:
            r.write(event, action)

    def attach(self, core: WorkerCore) -> None:
        for r in self.recorders:
            if hasattr(r, "attach"):
                r.attach(core)


class FlightRecorder:
    """Records a core to ``path`` (created or truncated), at most ``max_bytes``."""

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 1024:
            raise ValueError("a recording needs at least 1024 bytes")
        self.path = os.fspath(path)
        self.max_bytes = max_bytes
        self.written = 0
        self.lines = 0
        self.truncated = False
        self._file: IO[bytes] | None = io.open(self.path, "wb", buffering=_BUFFER_BYTES)
        self._encoder = msgspec.json.Encoder()

    def write(self, event: Event, action: Action | None) -> None:
        if self._file is None:
            return
        line = self._encoder.encode(RecordLine(event=event, action=action)) + b"\n"
        if self.written + len(line) > self.max_bytes - 32:
            self._file.write(b'{"truncated":true}\n')
            self.truncated = True
            self.close()
            return
        self._file.write(line)
        self.written += len(line)
        self.lines += 1

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None



class RecordingError(SidecarError):
    """A recording that cannot be read or replayed (not a recording, cut inside a line, a policy
    this release does not have)."""


class Divergence(msgspec.Struct, frozen=True):
    """The first step at which the replayed core answered otherwise than the recorded one."""

    line: int
    event: str  # the event, as recorded (JSON)
    recorded: str  # the recorded action (JSON, or null)
    replayed: str  # what the fresh core answered


class ReplayResult(msgspec.Struct):
    """How a replay went: ``events`` handed to the core, ``actions`` compared (all equal unless
    ``divergence``), by kind; ``truncated``: the recording ended at its size bound."""

    events: int = 0
    matched: int = 0
    by_action: dict[str, int] = {}
    truncated: bool = False
    from_snapshot: bool = False  # a ring's dump: replayed from the core's state at its start
    divergence: Divergence | None = None

    @property
    def ok(self) -> bool:
        return self.divergence is None


def replay(lines: Iterable[bytes]) -> ReplayResult:
    """Replay recorded ``lines`` (JSON, as ``FlightRecorder`` writes them) on a fresh core."""
    decoder = msgspec.json.Decoder(RecordLine)
    encoder = msgspec.json.Encoder()
    result = ReplayResult(by_action={})
    core: WorkerCore | None = None
    for number, raw in _numbered(lines):
        try:
            record = decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise RecordingError(f"line {number}: not a recorded step ({exc})") from None
        if record.truncated:
            result.truncated = True
            break
        if core is None:
            if not isinstance(record.event, Started):
                raise RecordingError(f"line {number}: a recording starts with the core's started line")
            try:
                core = WorkerCore(record.event)
            except (ValueError, TypeError) as exc:
                raise RecordingError(f"line {number}: cannot make the recorded core: {exc}") from None
            continue
        if record.snapshot is not None:
            if result.events:
                raise RecordingError(f"line {number}: a snapshot comes before the events")
            try:
                core.import_state(record.snapshot)
            except ValueError as exc:
                raise RecordingError(f"line {number}: the snapshot is not this core's state: {exc}") from None
            result.from_snapshot = True
            continue
        if record.event is None or isinstance(record.event, Started):
            raise RecordingError(f"line {number}: expected an event")
        try:
            action = core.handle(record.event)
        except (KeyError, ValueError, TypeError) as exc:
            raise RecordingError(f"line {number}: the core refused the recorded event: {exc!r}") from None
        result.events += 1
        if action != record.action:
            result.divergence = Divergence(
                line=number,
                event=encoder.encode(record.event).decode(),
                recorded=encoder.encode(record.action).decode(),
                replayed=encoder.encode(action).decode(),
            )
            break
        if action is not None:
            kind = str(type(action).__struct_config__.tag)
            result.by_action[kind] = result.by_action.get(kind, 0) + 1
            result.matched += 1
    if core is None:
        raise RecordingError("an empty recording")
    return result


def replay_file(path: str | os.PathLike[str]) -> ReplayResult:
    """Replay the recording at ``path``."""
    try:
        with open(path, "rb") as f:
            return replay(f)
    except OSError as exc:
        raise RecordingError(f"{os.fspath(path)}: {exc.strerror or exc}") from None


def _numbered(lines: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    for number, raw in enumerate(lines, start=1):
        raw = raw.strip()
        if raw:
            yield number, raw
