"""The quarantine's evidence records and grouping rule (sidecar/worker/quarantine.py), by state."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from jetbatch.sidecar.worker.quarantine import Evidence, groups


def test_a_record_says_how_the_process_died_with_the_request_inside() -> None:
    none = Evidence()
    assert Evidence.decode(none.encode(6)) == Evidence(0, 6)  # died in a group of 6
    assert Evidence.decode(none.encode(1)) == Evidence(1, 1)  # died alone: one alone crash
    assert Evidence.decode(Evidence(1, 1).encode(1)) == Evidence(2, 1)
    assert Evidence.decode(b"2") == Evidence(2, 1)  # a 0.2 record: alone crashes
    assert Evidence.decode(None) == Evidence()


@given(st.binary(max_size=64))
def test_a_forged_record_is_read_without_raising(raw: bytes) -> None:
    ev = Evidence.decode(raw)
    assert ev.alone_crashes >= 0 and (ev.crashed_in_group is None or ev.crashed_in_group >= 1)


def test_suspects_without_evidence_run_together_and_crashed_ones_alone() -> None:
    suspects = [(1, Evidence()), (2, Evidence(0, 6)), (3, Evidence()), (4, Evidence(1, 1))]
    assert groups(suspects) == [[0, 2], [1], [3]]
    assert groups([(1, Evidence()), (2, Evidence())]) == [[0, 1]]
    assert groups([]) == []
