"""sdk/connection.py: the connection jetbatch opens, and its header parser, which must read every
header block exactly as nats-py's own does."""

from __future__ import annotations

import nats.aio.client as nats_client
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


# nats-py 2.16's own table (nats/aio/client.py), written out: the module global may be swapped already.
_NATS_TABLE = {10: " ", 13: " "}


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=60) | st.lists(st.sampled_from(["\r", "\n", "\r\n", " ", "a", "é", "\x85", "\u2028", "\x7f", "\x80"]), max_size=10).map("".join))
def test_header_values_are_cleaned_as_nats_py_cleans_them(value: str) -> None:
    """The table jetbatch's connections give nats-py turns every value into what nats-py's own does
    (CR and LF to spaces, anything else, ASCII or not, left as it is)."""
    from jetbatch.sdk.connection import _HEADER_VALUE_TABLE

    assert value.translate(_HEADER_VALUE_TABLE) == value.translate(_NATS_TABLE)


@pytest.mark.anyio
async def test_connections_jetbatch_opens_read_and_clean_headers_with_its_own(nats_url: str, prefix: str) -> None:
    """A connection jetbatch opened reads header blocks with its parser and cleans header values
    with its table: CR and LF in a value cannot split the header block, they arrive as spaces, as
    with nats-py's own table."""
    nc = await connect_nats(nats_url)
    try:
        assert nc._parse_header_lines is parse_header_lines  # type: ignore[comparison-overlap]
        assert nats_client._HEADER_VALUE_NEWLINES != _NATS_TABLE  # swapped for the faster one
        sub = await nc.subscribe(f"{prefix}.headers")
        sent = {"Nats-Msg-Id": "r1", "Jetbatch-Deadline": "1700000000000", "Jetbatch-Model": "m1\r\nJetbatch-Tenant: evil", "Plain": "é ok"}
        await nc.publish(f"{prefix}.headers", b"x", headers=sent)
        msg = await sub.next_msg(timeout=5)
        assert msg.headers == {**sent, "Jetbatch-Model": "m1  Jetbatch-Tenant: evil"}
    finally:
        await nc.close()
