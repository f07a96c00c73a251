"""The quarantine's evidence records and grouping rule (sidecar/worker/quarantine.py), by state."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jetbatch.sidecar.worker.quarantine import Evidence, Quarantine, Verdict, groups


def test_a_record_says_how_the_process_died_with_the_request_inside() -> None:
    none = Evidence()
    assert Evidence.decode(none.encode(6, 40)) == Evidence(0, 6, 1, 40)  # died in a group of 6, tagged 40
    assert Evidence.decode(none.encode(1, 7)) == Evidence(1, 1, 1, 7)  # died alone: one alone crash
    assert Evidence.decode(Evidence(1, 1, 2, 7).encode(1, 7)) == Evidence(2, 1, 3, 7)
    assert Evidence.decode(b"0,6") == Evidence(0, 6, 1, 0)  # a 0.3 record: alone crashes, group
    assert Evidence.decode(b"2") == Evidence(2, 1, 2, 0)  # a 0.2 record: alone crashes
    assert Evidence.decode(None) == Evidence()


@given(st.binary(max_size=64))
def test_a_forged_record_is_read_without_raising(raw: bytes) -> None:
    ev = Evidence.decode(raw)
    assert ev.alone_crashes >= 0 and (ev.crashed_in_group is None or ev.crashed_in_group >= 1)


def test_suspects_without_evidence_run_together_and_a_crashed_group_is_cut_into_parts() -> None:
    suspects = [(1, Evidence()), (2, Evidence(0, 6, 1, 2)), (3, Evidence()), (4, Evidence(1, 1, 2, 4))]
    assert groups(suspects) == [[0, 2], [1], [3]]  # no evidence first, the lone crasher last
    assert groups([(1, Evidence()), (2, Evidence())]) == [[0, 1]]
    assert groups([]) == []
    # Eight that crashed together (tag 10) and two of another crashed group (tag 20): each cut
    # apart by sequence, never mixed; the parts of the group with fewer crashes on record first.
    eight = [(10 + i, Evidence(0, 8, 2, 10)) for i in range(8)]
    two = [(20 + i, Evidence(0, 4, 1, 20)) for i in range(2)]
    plan = groups(eight + two, fanout=2, rng=random.Random(1))
    assert sorted(map(sorted, plan)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8], [9]]
    assert set(plan[0] + plan[1]) == {8, 9}


def _convict(n: int, poisons: set[int], *, max_deliver: int = 5, fanout: int | None = None, seed: int = 0) -> tuple[int, int, set[int]]:
    """A fetch of ``n`` requests (stream sequences 1..n) holding ``poisons``, run delivery after
    delivery as the worker runs it: the first-time batch crashes, then the suspects run in the
    planned groups until one holding a poison kills the process (the members' records survive,
    as ``Quarantine.begin`` wrote them); those that ran before it are answered. Returns the
    crashes until every poison was convicted, the crashes before the last innocent was answered,
    and who was convicted."""
    q = Quarantine(js=None, subjects=None, max_deliver=max_deliver)  # type: ignore[arg-type]
    rng = random.Random(seed)
    evidence = {s: Evidence() for s in range(1, n + 1)}
    crashes, innocent_after, convicted = 1, 0, set()
    left = set(evidence)
    while left:
        for s in [s for s in left if q.verdict(crashes, evidence[s]) is Verdict.CULPRIT]:
            left.discard(s)
            convicted.add(s)
        order = sorted(left)
        kwargs = {} if fanout is None else {"fanout": fanout}
        for part in groups([(s, evidence[s]) for s in order], rng=rng, **kwargs):
            members = [order[i] for i in part]
            if poisons & set(members):
                for m in members:
                    evidence[m] = evidence[m].after_crash(len(members), min(members))
                crashes += 1
                break
            left -= set(members)
            innocent_after = crashes
        assert crashes < 60, "no end"
    return crashes, innocent_after, convicted


@pytest.mark.parametrize("seed", range(40))
def test_two_poisons_in_a_fetch_of_32_are_convicted_in_at_most_12_crashes_and_innocents_answered_after_4(seed: int) -> None:
    """The issue's target: two poisons in one fetch of 32 convicted in ≤ 12 crashes. Every
    innocent is answered after at most 4 crashes (the first batch, the suspects' group, and one
    lone crash of each poison run before it), a few ack waits; nobody innocent is convicted."""
    poisons = set(random.Random(seed).sample(range(1, 33), 2))
    crashes, innocent_after, convicted = _convict(32, poisons, seed=seed)
    assert convicted == poisons
    assert crashes <= 12 and innocent_after <= 4


def test_k_poisons_among_n_cost_about_k_log_n_crashes_whatever_the_cut() -> None:
    """Halves (``fanout=2``) cost k·log2(n) crashes and more; the default cut fewer, since a part
    that runs clean costs a batch and only a crash costs a restart and an ack wait."""
    for n, k in ((32, 1), (32, 2), (128, 3), (1024, 2)):
        for fanout in (2, None):
            worst = max(_convict(n, set(random.Random(s).sample(range(1, n + 1), k)), fanout=fanout, seed=s)[0] for s in range(10))
            # The first batch and the suspects' group, then per poison one crash a cut (log2 n or
            # log32 n of them) and a second lone crash.
            levels = math.ceil(math.log2(n)) if fanout == 2 else math.ceil(math.log(n, 32))
            bound = 2 + k * (levels + 1) if fanout == 2 else 2 + k * (levels + 2)
            assert worst <= bound, (n, k, fanout, worst)


def test_one_kill_from_outside_during_a_lone_run_convicts_nobody() -> None:
    """A worker killed from outside while an innocent ran in a group, then while it ran alone:
    no verdict yet (two lone crashes are needed, and ``max_deliver - 1`` in all)."""
    for max_deliver in (3, 5):
        q = Quarantine(js=None, subjects=None, max_deliver=max_deliver)  # type: ignore[arg-type]
        ev = Evidence().after_crash(8, 1).after_crash(1, 1)
        assert q.verdict(3, ev) is Verdict.RUN_ALONE
    q = Quarantine(js=None, subjects=None, max_deliver=3)  # type: ignore[arg-type]
    assert q.verdict(4, Evidence().after_crash(8, 1).after_crash(1, 1).after_crash(1, 1)) is Verdict.CULPRIT
