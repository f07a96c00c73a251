"""sdk/connection.py: the connection jetbatch opens, and its header parser, which must read every
header block exactly as nats-py's own does."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NATS

from jetbatch.sdk.connection import connect_nats, parse_header_lines

_PIECES = st.sampled_from([b"\r\n", b":", b" ", b"\t", b"\x1c", b"\x0b", b"\n", b"\r", b"Nats-Msg-Id", b"a b", b"\xff", "é".encode(), b"x"])
_LINES = st.lists(
    st.tuples(st.binary(max_size=12) | st.lists(_PIECES, max_size=4).map(b"".join), st.sampled_from([b":", b": ", b"", b"::"]),
              st.binary(max_size=20) | st.lists(_PIECES, max_size=4).map(b"".join)),
    max_size=8,
).map(lambda lines: b"\r\n".join(k + sep + v for k, sep, v in lines) + b"\r\n\r\n")  # fmt: skip


@settings(max_examples=500, deadline=None)
@given(_LINES | st.binary(max_size=200))
def test_the_header_parser_reads_every_block_as_nats_py_does(raw: bytes) -> None:
    assert parse_header_lines(raw) == NATS()._parse_header_lines(raw)


def test_the_header_parser_on_the_blocks_jetbatch_sees() -> None:
    raw = b"Nats-Msg-Id: r1\r\nJetbatch-Reply-Key:k1\r\nBad Name: dropped\r\n  Padded  :  kept  \r\n\r\n"
    assert parse_header_lines(raw) == {"Nats-Msg-Id": "r1", "Jetbatch-Reply-Key": "k1", "Padded": "kept"}


@pytest.mark.anyio
async def test_connections_jetbatch_opens_read_headers_with_it(nats_url: str, prefix: str) -> None:
    nc = await connect_nats(nats_url)
    try:
        assert nc._parse_header_lines is parse_header_lines  # type: ignore[comparison-overlap]
        sub = await nc.subscribe(f"{prefix}.headers")
        await nc.publish(f"{prefix}.headers", b"x", headers={"Nats-Msg-Id": "r1", "Jetbatch-Deadline": "1700000000000"})
        msg = await sub.next_msg(timeout=5)
        assert msg.headers == {"Nats-Msg-Id": "r1", "Jetbatch-Deadline": "1700000000000"}
    finally:
        await nc.close()
