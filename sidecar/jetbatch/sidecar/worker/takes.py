"""What peers said they took from each queue and have not settled: their take events
(``<prefix>.taken.<model>``), kept per model and peer with limits. Anyone who may publish there
can send one, so a take is a hint: the counts that read this table check it against the stream
(``QueueView.counted``, ``Lines.check_takes``)."""

from __future__ import annotations

import math

__all__ = ["MAX_PEERS_A_MODEL", "MAX_PEER_HELD", "PeerTakes"]

# Limits on the take events (core messages any worker-permitted client can send: hostile input).
MAX_PEER_HELD = 100_000
MAX_PEERS_A_MODEL = 256  # peers whose unsettled takes of one model are kept


class PeerTakes:
    """``peer_event_s``: how long a peer's take event counts its requests as the peer's (until it
    settles them, or its advert, sent every heartbeat, says what it holds)."""

    def __init__(self, peer_event_s: float = 2.0) -> None:
        self.peer_event_s = peer_event_s
        # model -> peer -> (requests it took and has not settled, when last told)
        self._peer_held: dict[str, dict[str, tuple[int, float]]] = {}
        self._peers_pruned_at: dict[str, float] = {}  # model -> when took() last dropped old entries

    def took(self, name: str, peer: str, n: int, now: float) -> bool:
        """A peer fetched ``n`` of the queue's requests (its take event): until it settles them
        they are the peer's, not waiting and not stranded (``QueueView.peer_took`` takes them
        out of the backlog at once, not at the next count). Without it a
        peer's served requests stayed in the count for up to a poll interval, and a worker loaded
        a model for requests already answered (the 4-worker bench: more loads than batches).
        False when the take is not counted (a new peer past ``MAX_PEERS_A_MODEL``)."""
        held = self._peer_held.setdefault(name, {})
        if peer not in held and len(held) >= MAX_PEERS_A_MODEL:
            # Entries go when the model waits (hold) or the peer leaves the view: events
            # under ever new ids (anyone who may publish take events) grew this for good. Old
            # ones are dropped at most once a second; a new peer past the limit is not counted
            # (an over-count, which the next count corrects).
            if now - self._peers_pruned_at.get(name, -math.inf) > 1.0:
                self._peers_pruned_at[name] = now
                self.hold(name, now)
                held = self._peer_held.setdefault(name, {})
            if len(held) >= MAX_PEERS_A_MODEL:
                return False
        count = held.get(peer, (0, now))[0]
        held[peer] = (min(count + n, MAX_PEER_HELD), now)
        return True

    def settled(self, name: str, peer: str, n: int, now: float) -> None:
        """A peer answered (or gave back) ``n`` requests it took."""
        held = self._peer_held.get(name)
        if not held or peer not in held:
            return
        left = held[peer][0] - n
        if left > 0:
            held[peer] = (left, now)
        else:
            del held[peer]
            if not held:
                del self._peer_held[name]

    def forget(self, peers: list[str]) -> None:
        """Peers that left (or whose process was replaced under the same id): what their take
        events said they hold is theirs no more. A killed process never sends its settle event,
        and its successor's events would keep that hold alive under the same id (the successor's
        first takes may be forgotten with it: an over-count, which costs an empty fetch)."""
        for name in list(self._peer_held):
            held = self._peer_held[name]
            for peer in peers:
                held.pop(peer, None)
            if not held:
                del self._peer_held[name]

    def hold(self, name: str, now: float) -> int:
        """What peers said they took from ``name``'s queue and have not settled (recent events)."""
        held = self._peer_held.get(name)
        if not held:
            return 0
        for peer in [p for p, (_, at) in held.items() if now - at > self.peer_event_s]:
            del held[peer]  # a lost settle event, or a peer gone: its advert or the ack wait tells
        if not held:
            del self._peer_held[name]
        return sum(c for c, _ in held.values())
