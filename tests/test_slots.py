"""sidecar/worker/slots.py: what a JetStream delivery's ack subject says, read without nats-py's
metadata objects, and read the same way."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.msg import Msg

from jetbatch.sidecar.worker.slots import ack_info, enqueued_at

_N = st.integers(min_value=0, max_value=2**63 - 1)
_TOKEN = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=12)


@st.composite
def _ack_subjects(draw: st.DrawFn) -> str:
    fields = [str(draw(_N)) for _ in range(5)]  # delivered, stream seq, consumer seq, ns, pending
    if draw(st.booleans()):
        return ".".join(["$JS", "ACK", draw(_TOKEN), draw(_TOKEN), *fields])  # V1
    tail = [draw(_TOKEN)] if draw(st.booleans()) else []
    return ".".join(["$JS", "ACK", draw(_TOKEN), draw(_TOKEN), draw(_TOKEN), draw(_TOKEN), *fields, *tail])  # V2: domain, account


def _msg(reply: str | None) -> Msg:
    return Msg(None, subject="s", reply=reply or "", data=b"")  # type: ignore[arg-type]


@given(_ack_subjects())
def test_an_ack_subject_reads_as_nats_py_reads_it(reply: str) -> None:
    msg, theirs = _msg(reply), _msg(reply).metadata
    info = ack_info(msg)
    assert info is not None
    assert (info.delivered, info.stream_seq, info.pending) == (theirs.num_delivered, theirs.sequence.stream, theirs.num_pending)
    assert info.stored_at_s == pytest.approx(theirs.timestamp.timestamp(), abs=1e-6)


@given(st.text(max_size=200) | _ack_subjects().map(lambda s: s.replace("1", "x", 1)) | st.just("$JS.ACK.a.b.1.2.3"))
def test_anything_else_is_no_jetstream_delivery_and_never_raises(reply: str) -> None:
    msg = _msg(reply)
    info = ack_info(msg)
    try:
        _msg(reply).metadata
    except Exception:  # noqa: BLE001 - nats-py refuses it: so do we
        assert info is None
    if info is None:
        assert enqueued_at(msg, 5.0) == 5.0


def test_a_delivery_stored_later_than_now_counts_as_stored_now() -> None:
    msg = _msg("$JS.ACK.S.C.2.10.7.1800000000000000000.3")
    assert ack_info(msg) == (2, 10, 1.8e9, 3)
    assert enqueued_at(msg, 1.7e9) == 1.7e9 and enqueued_at(msg, 1.9e9) == 1.8e9
