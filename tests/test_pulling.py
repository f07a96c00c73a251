"""The worker's pull (sidecar/pulling.py) against a real nats-server: what is stored comes at
once, arrivals are waited for within the timeout, late deliveries go to the next fetch, and a
consumer removed under a waiting pull ends it instead of hanging."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from types import SimpleNamespace
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from nats.aio.msg import Msg

from jetbatch.sidecar.pulling import Puller
from jetbatch.sidecar.worker.stream_facts import missed_by
from tests.helpers import pull_waiting, wait_until

pytestmark = pytest.mark.anyio


async def _queue(url: str, prefix: str) -> tuple[object, object]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name=prefix.upper(), subjects=[f"{prefix}.q"], retention="workqueue")
    await js.add_consumer(prefix.upper(), durable_name="c", ack_policy="explicit")
    return nc, js


@contextlib.asynccontextmanager
async def _pulling(url: str, prefix: str, **options: Any) -> AsyncIterator[tuple[object, object, Puller]]:
    """A work queue and its consumer (``_queue``), a started puller of it, and the connection
    closed at the end."""
    nc, js = await _queue(url, prefix)
    try:
        yield nc, js, await Puller(nc, prefix.upper(), "c", **options).start()
    finally:
        await nc.close()  # type: ignore[attr-defined]


async def test_stored_messages_come_at_once_and_arrivals_within_the_wait(nats_url: str, prefix: str) -> None:
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        for i in range(3):
            await js.publish(f"{prefix}.q", str(i).encode())  # type: ignore[attr-defined]
        started = time.monotonic()
        got = await puller.fetch(64, timeout=5.0)
        assert [m.data for m in got] == [b"0", b"1", b"2"]
        assert time.monotonic() - started < 2.0  # stored: not the 5 s wait for a full batch
        assert got[0].metadata.sequence.stream == 1  # a JetStream message: metadata, acks
        for m in got:
            await m.ack()
        assert await puller.fetch(8, timeout=0.2) == []  # nothing stored, nothing arrived

        fetch = asyncio.ensure_future(puller.fetch(1, timeout=5.0))
        await pull_waiting(js, prefix.upper())  # the fetch waits at the server: now one arrives
        await js.publish(f"{prefix}.q", b"late")  # type: ignore[attr-defined]
        assert [m.data for m in await fetch] == [b"late"]
        await puller.unsubscribe()


async def test_an_empty_fetch_waits_its_whole_timeout(nats_url: str, prefix: str) -> None:
    """The server ends the pull request a hair before the fetch's deadline, not milliseconds
    before (an idle wait ends when it says). A lower bound only: how late it ends depends on the
    host."""
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        for timeout_s in (0.05, 0.02):
            started = time.monotonic()
            assert await puller.fetch(8, timeout=timeout_s) == []
            assert time.monotonic() - started >= timeout_s - 0.0005
        info = await js.consumer_info(prefix.upper(), "c")  # type: ignore[attr-defined]
        assert info.num_waiting == 0  # each request ended at the server before its fetch returned


async def test_a_removed_consumer_ends_a_waiting_pull(nats_url: str, prefix: str) -> None:
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        fetch = asyncio.ensure_future(puller.fetch(4, timeout=30.0))
        await pull_waiting(js, prefix.upper())
        await js.delete_consumer(prefix.upper(), "c")  # type: ignore[attr-defined]
        assert await asyncio.wait_for(fetch, 10) == []  # 409 Consumer Deleted ends it


async def test_an_idle_fetch_with_linger_returns_at_the_first_arrival_and_leaves_no_request_behind(nats_url: str, prefix: str) -> None:
    """The classifier's idle wait: a fetch for a whole batch, lingering for one, returns when one
    request comes (not at its 30 s timeout, nor when 64 came), and its waiting request, satisfied,
    takes nothing more: the next arrival stays in the stream for the next fetch."""
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        fetch = asyncio.ensure_future(puller.fetch(64, timeout=30.0, linger=1))
        await pull_waiting(js, prefix.upper())
        await js.publish(f"{prefix}.q", b"first")  # type: ignore[attr-defined]
        assert [m.data for m in await asyncio.wait_for(fetch, 10)] == [b"first"]
        await js.publish(f"{prefix}.q", b"second")  # type: ignore[attr-defined]
        info = await js.consumer_info(prefix.upper(), "c")  # type: ignore[attr-defined]
        assert (info.num_pending, info.num_waiting) == (1, 0)
        assert [m.data for m in await puller.fetch(64, timeout=5.0)] == [b"second"]
        await puller.unsubscribe()


def _count_pulls(nc: Any) -> list[dict[str, Any]]:
    """The pull requests ``nc`` sends from now on (their bodies), in order."""
    sent: list[dict[str, Any]] = []
    publish = nc.publish

    async def counting(subject: str, payload: bytes = b"", reply: str = "", headers: Any = None) -> None:
        if subject.startswith("$JS.API.CONSUMER.MSG.NEXT."):
            sent.append(json.loads(payload))
        await publish(subject, payload, reply=reply, headers=headers)

    nc.publish = counting
    return sent


async def test_a_hold_is_one_request_whose_later_deliveries_wait_in_the_buffer_and_cover_a_fill(nats_url: str, prefix: str) -> None:
    """A worker's hold (``fetch(hold_open_s=...)``): one pull request for a whole batch, held open. It
    returns with what is stored, or else with the first arrival, and the request stays open:
    later arrivals land in the buffer, and a fill while it still covers the window sends no
    request of its own. One request where a fetch sends a ``no_wait`` one (and gets its 404)
    and then a second one."""
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        sent = _count_pulls(nc)
        for i in range(3):
            await js.publish(f"{prefix}.q", f"stored{i}".encode())  # type: ignore[attr-defined]
        got = await puller.fetch(64, timeout=30.0, hold_open_s=30.0)
        await wait_until(lambda: len(got) + puller.buffered == 3, timeout_s=10, what="the stored three delivered")
        if puller.buffered:  # what came after the fetch's first wake: the next fetch's, no request
            got += await puller.fetch(64, timeout=5.0)
        assert [m.data for m in got] == [b"stored0", b"stored1", b"stored2"]
        assert len(sent) == 1 and "no_wait" not in sent[0] and sent[0]["batch"] == 64
        info = await js.consumer_info(prefix.upper(), "c")  # type: ignore[attr-defined]
        assert info.num_waiting == 1  # still open for arrivals

        await js.publish(f"{prefix}.q", b"arrived")  # type: ignore[attr-defined]
        await wait_until(lambda: puller.buffered == 1, timeout_s=10, what="the arrival in the buffer")
        fill = asyncio.ensure_future(puller.fill(3, wait_s=5.0))
        await js.publish(f"{prefix}.q", b"during the fill")  # type: ignore[attr-defined]
        await js.publish(f"{prefix}.q", b"fills it")  # type: ignore[attr-defined]
        assert [m.data for m in await asyncio.wait_for(fill, 10)] == [b"arrived", b"during the fill", b"fills it"]
        assert len(sent) == 1 == puller.pulls  # the hold's request covered the fill

        # A request that ended since (a no_wait one: nothing stored) does not end a fill the
        # hold's request covers: the fill waits for what that one brings.
        assert await puller.fetch(4, timeout=5.0, stored_only=True) == []
        assert len(sent) == 2 and sent[1].get("no_wait")
        fill = asyncio.ensure_future(puller.fill(1, wait_s=5.0))
        await js.publish(f"{prefix}.q", b"after the 404")  # type: ignore[attr-defined]
        assert [m.data for m in await asyncio.wait_for(fill, 10)] == [b"after the 404"]
        assert len(sent) == 2
        for m in got:
            await m.ack()


async def test_a_fill_a_hold_covers_in_part_asks_only_for_the_rest(nats_url: str, prefix: str) -> None:
    """A fill whose batch is more than the hold's request still open past the fill's end will
    bring: it asks only for the rest, so the two bring the batch and nothing more (two requests
    each for the whole rest left a request's worth in this puller)."""
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        sent = _count_pulls(nc)
        fetch = asyncio.ensure_future(puller.fetch(3, timeout=30.0, hold_open_s=60.0))
        await pull_waiting(js, prefix.upper())
        await js.publish(f"{prefix}.q", b"first")  # type: ignore[attr-defined]
        got = await asyncio.wait_for(fetch, 10)
        fill = asyncio.ensure_future(puller.fill(4, wait_s=30.0))  # the hold's request outlasts it
        for i in range(4):
            await js.publish(f"{prefix}.q", f"r{i}".encode())  # type: ignore[attr-defined]
        got += await asyncio.wait_for(fill, 10)
        assert [m.data for m in got] == [b"first", b"r0", b"r1", b"r2", b"r3"]
        assert [body["batch"] for body in sent] == [3, 2]  # the hold's 3; the fill's 4 less its 2
        await js.publish(f"{prefix}.q", b"for the next batch")  # type: ignore[attr-defined]
        info = await js.consumer_info(prefix.upper(), "c")  # type: ignore[attr-defined]
        assert (info.num_pending, info.num_waiting, puller.buffered) == (1, 0, 0)  # stored, not ours


async def test_a_fill_counts_on_no_request_that_ends_before_it_does(nats_url: str, prefix: str) -> None:
    """A hold's request that expires inside the next window (the window opened on a delivery it
    left in the buffer) brings nothing after its end: the fill asks for its whole rest itself.
    Counting on it left the fill a request short of its batch, waiting out its window while
    the rest stayed stored."""
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        sent = _count_pulls(nc)
        await js.publish(f"{prefix}.q", b"first")  # type: ignore[attr-defined]
        got = await puller.fetch(3, timeout=0.3, hold_open_s=0.3)  # stored: at once, and open on
        fill = asyncio.ensure_future(puller.fill(4, wait_s=60.0))  # outlasts the hold's request
        await wait_until(lambda: puller.ends == 1, timeout_s=10, what="the hold's request ended")
        for i in range(4):
            await js.publish(f"{prefix}.q", f"r{i}".encode())  # type: ignore[attr-defined]
        got += await asyncio.wait_for(fill, 10)
        assert [m.data for m in got] == [b"first", b"r0", b"r1", b"r2", b"r3"]
        assert [body["batch"] for body in sent] == [3, 4]


async def test_a_window_s_request_left_open_serves_the_next_hold_and_ends_filled(nats_url: str, prefix: str) -> None:
    """A worker serving a model's batches back to back (``fill(open_s=...)``): the window's
    request stays open past it, the next hold sends none of its own and takes the next arrival
    from it, and the request ends filled, with no 408 to read."""
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        sent = _count_pulls(nc)
        await js.publish(f"{prefix}.q", b"a")  # type: ignore[attr-defined]
        got = await puller.fill(2, wait_s=0.05, open_s=60.0)
        assert [m.data for m in got] == [b"a"] and [body["batch"] for body in sent] == [2]
        hold = asyncio.ensure_future(puller.fetch(64, timeout=30.0, hold_open_s=30.0))
        await js.publish(f"{prefix}.q", b"b")  # type: ignore[attr-defined]
        got += await asyncio.wait_for(hold, 10)
        assert [m.data for m in got] == [b"a", b"b"]
        assert len(sent) == 1 and puller.ends == 0
        info = await js.consumer_info(prefix.upper(), "c")  # type: ignore[attr-defined]
        assert (info.num_waiting, info.num_ack_pending) == (0, 2)  # filled, and both delivered here


async def test_a_hold_whose_open_request_ends_empty_handed_asks_for_itself(nats_url: str, prefix: str) -> None:
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        sent = _count_pulls(nc)
        assert await puller.fill(2, wait_s=0.01, open_s=0.3) == []  # open 0.3 s past its start
        hold = asyncio.ensure_future(puller.fetch(64, timeout=30.0, hold_open_s=30.0))
        await wait_until(lambda: puller.ends == 1 and len(sent) == 2, timeout_s=10, what="the hold's own request")
        await js.publish(f"{prefix}.q", b"first")  # type: ignore[attr-defined]
        assert [m.data for m in await asyncio.wait_for(hold, 10)] == [b"first"]
        assert [body["batch"] for body in sent] == [2, 64]
        await puller.close(0.0)


async def test_a_request_s_end_recounts_what_the_younger_ones_still_bring(nats_url: str, prefix: str) -> None:
    """nats-server serves open pull requests in turn, and a delivery does not say whose it is: it
    is counted against the oldest. The oldest's end says how many it still had; counted too
    high, the younger one looked open after it had filled, and the next hold waited on it to
    its end (30 s here) while the arrival stayed stored."""
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        sent = _count_pulls(nc)
        assert await puller.fill(2, wait_s=0.01, open_s=2.0) == []  # open 2 s past its start
        # Too short-lived for this window, so the fill asks for all of it: two requests open.
        fill = asyncio.ensure_future(puller.fill(2, wait_s=30.0, open_s=60.0))
        await wait_until(lambda: len(sent) == 2, timeout_s=10, what="the second request")
        await js.publish(f"{prefix}.q", b"m0")  # type: ignore[attr-defined]
        await js.publish(f"{prefix}.q", b"m1")  # type: ignore[attr-defined]
        got = await asyncio.wait_for(fill, 10)  # one each: the first request still has one to bring
        await wait_until(lambda: puller.ends == 1, timeout_s=10, what="the first request's end")
        for i in (2, 3):
            hold = asyncio.ensure_future(puller.fetch(64, timeout=30.0, hold_open_s=30.0))
            await js.publish(f"{prefix}.q", f"m{i}".encode())  # type: ignore[attr-defined]
            got += await asyncio.wait_for(hold, 10)
        assert [m.data for m in got] == [b"m0", b"m1", b"m2", b"m3"]
        assert [body["batch"] for body in sent] == [2, 2, 64]  # m2 filled the second; m3 asked anew
        await puller.close(0.0)


async def test_a_request_that_ends_with_more_than_counted_gives_it_back_to_the_older_one(nats_url: str, prefix: str) -> None:
    """The other way round: the younger request ends first, with fewer left than counted (it had
    a delivery counted against the older one). The older one is then still open, and a count
    taken after :meth:`Puller.quiesce` must wait for it, or what it delivers after the count's
    answer is in neither (found by a review: the older one looked filled)."""
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        sent = _count_pulls(nc)
        await js.publish(f"{prefix}.q", b"m0")  # type: ignore[attr-defined]
        got = await puller.fetch(3, timeout=60.0, hold_open_s=60.0)  # open 60 s, 2 to come
        # A plain fetch: what is stored (nothing: a 404), then a request for 2 open 2 s.
        fetch = asyncio.ensure_future(puller.fetch(2, timeout=2.0))
        await wait_until(lambda: len(sent) == 3, timeout_s=10, what="the fetch's waiting request")
        await js.publish(f"{prefix}.q", b"m1")  # type: ignore[attr-defined]
        await js.publish(f"{prefix}.q", b"m2")  # type: ignore[attr-defined]
        got += await asyncio.wait_for(fetch, 10)
        await wait_until(lambda: puller.ends == 2, timeout_s=10, what="the fetch's request's end")
        assert [m.data for m in got] == [b"m0", b"m1", b"m2"]
        assert not await puller.quiesce(0.05)  # the hold's request still brings one
        info = await js.consumer_info(prefix.upper(), "c")  # type: ignore[attr-defined]
        assert info.num_waiting == 1
        await js.publish(f"{prefix}.q", b"m3")  # type: ignore[attr-defined]
        await wait_until(lambda: puller.buffered == 1, timeout_s=10, what="m3 in the puller")
        assert await puller.quiesce(10.0)  # filled: nothing more to wait for


async def test_a_fill_counts_on_a_request_open_past_its_own_end_not_past_its_request_s(nats_url: str, prefix: str) -> None:
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        sent = _count_pulls(nc)
        await js.publish(f"{prefix}.q", b"m0")  # type: ignore[attr-defined]
        got = await puller.fetch(3, timeout=60.0, hold_open_s=60.0)
        fill = asyncio.ensure_future(puller.fill(2, wait_s=5.0, open_s=120.0))  # the hold's request covers it
        await js.publish(f"{prefix}.q", b"m1")  # type: ignore[attr-defined]
        await js.publish(f"{prefix}.q", b"m2")  # type: ignore[attr-defined]
        got += await asyncio.wait_for(fill, 10)
        assert [m.data for m in got] == [b"m0", b"m1", b"m2"] and len(sent) == 1


async def test_a_fill_takes_what_an_open_request_brings_before_it_asks_for_the_rest(nats_url: str, prefix: str) -> None:
    """A request open past a fill's end that brings only part of its batch (a hold's, which an
    earlier window took from) brings that part first; the fill asks for the rest only once it
    came, with time left. At light traffic no request is sent: asked for at once, a request
    for a batch's last few went out every window and ended with a 408."""
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        sent = _count_pulls(nc)
        await js.publish(f"{prefix}.q", b"m0")  # type: ignore[attr-defined]
        got = await puller.fetch(3, timeout=60.0, hold_open_s=60.0)  # open 60 s, 2 to come
        assert await puller.fill(4, wait_s=0.05) == [] and len(sent) == 1  # nothing came: nothing asked
        fill = asyncio.ensure_future(puller.fill(4, wait_s=30.0))
        for i in (1, 2):
            await js.publish(f"{prefix}.q", f"m{i}".encode())  # type: ignore[attr-defined]
        # The hold's request brought its 2: the fill asks for the other 2, and they come.
        await wait_until(lambda: len(sent) == 2, timeout_s=10, what="the request for the rest")
        assert sent[-1]["batch"] == 2
        for i in (3, 4):
            await js.publish(f"{prefix}.q", f"m{i}".encode())  # type: ignore[attr-defined]
        got += await asyncio.wait_for(fill, 10)
        assert [m.data for m in got] == [b"m0", b"m1", b"m2", b"m3", b"m4"] and len(sent) == 2


async def test_after_a_count_what_an_open_request_delivers_that_the_count_missed_is_reported(nats_url: str, prefix: str) -> None:
    """``watch``: a count of the consumer was answered while a hold's request is still open. The
    buffered messages the count missed are returned, and each later delivery it missed goes to
    ``on_uncounted``: by the first predicate until the next watch or until it says None (the
    worker's, ``queues.missed_by``, reads first deliveries' stream sequences: one landing late
    after a stall of the loop is still reported), by the second only until every request open
    at the count has ended (redeliveries). Here the predicates name the messages."""
    nc, js = await _queue(nats_url, prefix)
    reported: list[bytes] = []

    def before(msg: Msg) -> bool | None:
        return True if msg.data.startswith(b"missed") else None if msg.data == b"later" else False

    try:
        puller = await Puller(nc, prefix.upper(), "c", on_uncounted=lambda msg: reported.append(msg.data)).start()
        assert await puller.fetch(4, timeout=0.01, hold_open_s=0.5) == []  # its request open 0.5 s, for 4
        assert puller.watch(before, lambda msg: msg.data.startswith(b"again")) == 0
        for data in (b"counted", b"missed1", b"again1"):
            await js.publish(f"{prefix}.q", data)  # type: ignore[attr-defined]
        await wait_until(lambda: puller.buffered == 3, timeout_s=10, what="the three in the puller")
        assert reported == [b"missed1", b"again1"]
        assert puller.watch(before, lambda msg: True) == 3 and puller.watch(before) == 1
        puller.watch(before, lambda msg: msg.data.startswith(b"again"))
        await wait_until(lambda: puller.ends == 1, timeout_s=10, what="the request's end (a 408)")
        assert [m.data for m in await puller.fetch(3, timeout=5.0)] == [b"counted", b"missed1", b"again1"]
        for data in (b"again2", b"missed2", b"later", b"missed3"):
            await js.publish(f"{prefix}.q", data)  # type: ignore[attr-defined]
        got = await puller.fetch(4, timeout=5.0)
        got += await puller.fetch(4, timeout=5.0) if len(got) < 4 else []
        assert [m.data for m in got] == [b"again2", b"missed2", b"later", b"missed3"]
        # The second predicate no longer (the request open at the watch ended), the first until "later".
        assert reported == [b"missed1", b"again1", b"missed2"]
    finally:
        await nc.close()  # type: ignore[attr-defined]


async def test_a_delivery_a_count_missed_is_reported_however_late_the_loop_reads_it(nats_url: str, prefix: str) -> None:
    """Found by a review: the request open at the count delivered a request before the count was
    taken, and a stalled event loop read it only after that request's latest end. Reporting
    first deliveries only until then left it counted nowhere; they are reported until the
    next count. The stall is the event loop blocked (a busy host), the publish from a thread."""
    nc, js = await _queue(nats_url, prefix)
    reported: list[bytes] = []
    try:
        puller = await Puller(nc, prefix.upper(), "c", on_uncounted=lambda msg: reported.append(msg.data)).start()
        assert await puller.fetch(4, timeout=0.001, hold_open_s=1.0) == []  # its request open 1 s
        started = time.monotonic()
        # The count's answer said stream sequence 1 was delivered when it was taken.
        assert puller.watch(*missed_by(SimpleNamespace(delivered=SimpleNamespace(stream_seq=1)))) == 0

        def publish() -> None:
            async def once() -> None:
                other = await nats.connect(nats_url)
                await other.jetstream().publish(f"{prefix}.q", b"missed")
                await other.close()

            asyncio.run(once())

        thread = threading.Thread(target=publish)
        thread.start()
        thread.join()  # delivered to the open request while the loop does not run
        assert time.monotonic() - started < 0.9, "the publish came after the request's expiry: nothing shown"
        time.sleep(max(0.0, 1.1 - (time.monotonic() - started)))  # the stall, past the request's latest end
        await wait_until(lambda: puller.buffered == 1, timeout_s=5, what="the delivery read")
        assert reported == [b"missed"]
    finally:
        await nc.close()  # type: ignore[attr-defined]


async def test_an_interrupt_ends_a_holds_wait_and_its_request_serves_the_next_fetch(nats_url: str, prefix: str) -> None:
    """A hold waits for its first delivery until another's arrival interrupts it: it returns
    empty-handed at once, and its request, still open, serves the next fetch. An interrupt
    with no hold waiting ends the next one at once, with no request, unless taken back."""
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        sent = _count_pulls(nc)
        puller.interrupt()
        assert await puller.fetch(3, timeout=60.0, hold_open_s=60.0) == [] and sent == []
        puller.interrupt()
        puller.resume()
        hold = asyncio.ensure_future(puller.fetch(3, timeout=60.0, hold_open_s=60.0))
        await wait_until(lambda: len(sent) == 1, timeout_s=10, what="the hold's request")
        puller.interrupt()
        assert await asyncio.wait_for(hold, 10) == []
        await js.publish(f"{prefix}.q", b"m0")  # type: ignore[attr-defined]
        got = await puller.fetch(3, timeout=10.0, hold_open_s=10.0)
        assert [m.data for m in got] == [b"m0"] and len(sent) == 1  # the cut hold's request brought it


async def test_a_hold_refused_at_once_sends_no_second_request(nats_url: str, prefix: str) -> None:
    """A request refused with a 409 (the consumer's waiting requests at their limit) ends a hold
    that asked for itself: asking again at once spun a request a round trip."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await js.add_stream(name=prefix.upper(), subjects=[f"{prefix}.q"], retention="workqueue")
        await js.add_consumer(prefix.upper(), durable_name="c", ack_policy="explicit", max_waiting=1)
        other = await Puller(nc, prefix.upper(), "c").start()
        waiting = asyncio.ensure_future(other.fetch(1, timeout=30.0, hold_open_s=30.0))  # the one waiting slot
        await pull_waiting(js, prefix.upper())
        puller = await Puller(nc, prefix.upper(), "c").start()
        assert await puller.fetch(64, timeout=0.5, hold_open_s=0.5) == []
        assert (puller.pulls, puller.ends) == (1, 1)
        waiting.cancel()
    finally:
        await nc.close()


async def test_a_request_that_could_not_be_sent_is_not_counted_on(nats_url: str, prefix: str) -> None:
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        publish = nc.publish  # type: ignore[attr-defined]

        async def refused(*args: Any, **kwargs: Any) -> None:
            nc.publish = publish  # type: ignore[attr-defined]
            raise nats.errors.OutboundBufferLimitError

        nc.publish = refused  # type: ignore[attr-defined]
        with pytest.raises(nats.errors.OutboundBufferLimitError):
            await puller.fetch(64, timeout=30.0, hold_open_s=30.0)
        sent = _count_pulls(nc)
        fill = asyncio.ensure_future(puller.fill(1, wait_s=10.0))  # within the hold's 30 s, had it gone out
        await wait_until(lambda: len(sent) == 1, timeout_s=5, what="the fill's own request")
        await js.publish(f"{prefix}.q", b"m0")  # type: ignore[attr-defined]
        assert [m.data for m in await asyncio.wait_for(fill, 10)] == [b"m0"]


async def test_a_stored_request_with_a_status_header_and_no_body_is_a_delivery(nats_url: str, prefix: str) -> None:
    """Statuses come on the pull request's reply subject; a stored request names its stream
    subject. One with no body and headers of its own (a Status, a huge pending count) is
    handed out like any other, not taken for an end or an error."""
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        headers = {"Status": "503", "Description": "No Responders", "Nats-Pending-Messages": "99999"}
        await js.publish(f"{prefix}.q", b"", headers=headers)  # type: ignore[attr-defined]
        got = await puller.fetch(4, timeout=5.0)
        assert len(got) == 1 and got[0].headers["Status"] == "503"
        await got[0].ack()
        assert await puller.fetch(4, timeout=0.05) == []  # no PullError


async def test_only_what_jetstream_sends_reaches_the_buffer(nats_url: str, prefix: str) -> None:
    """Anyone who may publish to a puller's inbox (its name is on the wire in every pull
    request) can send it a message, and whoever may use the JetStream API can have a consumer
    of their own deliver to it. One on the inbox with a body, a status on no request this puller
    sent, or another consumer's delivery is dropped and counted (taken as a delivery, the worker
    answered it under the tenant it claimed and acked it where its reply subject said); an error
    status for a request that has ended raises nothing; the consumer's deliveries still count."""
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        sniffed = await nc.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.{prefix.upper()}.c")  # type: ignore[attr-defined]
        assert await puller.fetch(4, timeout=0.05) == []
        inbox = (await sniffed.next_msg(timeout=5)).reply.rsplit(".", 1)[0]
        attacker = await nats.connect(nats_url)
        try:
            forged = [
                (f"{inbox}.1", b"a request, with any headers", {"Jetbatch-Tenant": "other"}),
                (f"{inbox}.1", b"", None),  # neither a status nor a delivery
                (f"{inbox}.x", b"", {"Status": "503"}),
                (f"{inbox}.99", b"", {"Status": "408"}),  # not sent yet
                (f"{inbox}." + "9" * 1000, b"", {"Status": "408"}),
                (f"{inbox}.\u00b2", b"", {"Status": "408"}),  # a digit to str.isdigit, not to int()
            ]
            for subject, data, headers in forged:
                await attacker.publish(subject, data, reply="forged.ack", headers=headers)
            await attacker.publish(f"{inbox}.1", b"", headers={"Status": "503", "Description": "forged"})  # request 1 has ended
            # Delivered by JetStream itself, from a stream and consumer of the attacker's (a pull
            # request of theirs, with this inbox as its reply): not this puller's consumer.
            ajs = attacker.jetstream()
            await ajs.add_stream(name=f"{prefix.upper()}EVIL", subjects=[f"{prefix}.evil"])
            await ajs.add_consumer(f"{prefix.upper()}EVIL", durable_name="c", ack_policy="explicit")
            await ajs.publish(f"{prefix}.evil", b"delivered by a consumer not ours", headers={"Jetbatch-Tenant": "other"})
            await attacker.publish(f"$JS.API.CONSUMER.MSG.NEXT.{prefix.upper()}EVIL.c", b'{"batch": 1}', reply=f"{inbox}.1")
            forged.append((f"{prefix}.evil", b"", None))
            await attacker.flush()
            await wait_until(lambda: puller.forged == len(forged), timeout_s=5, what="the forgeries dropped")
        finally:
            await attacker.close()
        assert puller.buffered == 0
        await js.publish(f"{prefix}.q", b"real")  # type: ignore[attr-defined]
        got = await puller.fetch(4, timeout=5.0)  # no PullError: the 503 was for no open request
        assert [m.data for m in got] == [b"real"] and got[0].metadata.sequence.stream == 1
        assert puller.forged == len(forged)


async def test_a_hold_returns_at_the_first_arrival_or_empty_at_its_end(nats_url: str, prefix: str) -> None:
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        started = time.monotonic()
        assert await puller.fetch(64, timeout=0.05, hold_open_s=0.05) == []
        assert time.monotonic() - started >= 0.05 - 0.0005  # it waited its whole hold
        info = await js.consumer_info(prefix.upper(), "c")  # type: ignore[attr-defined]
        assert info.num_waiting == 0  # ended at the server by its expiry before the fetch returned
        assert (puller.pulls, puller.ends) == (1, 1)  # one request, its 408

        fetch = asyncio.ensure_future(puller.fetch(64, timeout=30.0, hold_open_s=30.0))
        await pull_waiting(js, prefix.upper())
        await js.publish(f"{prefix}.q", b"first")  # type: ignore[attr-defined]
        assert [m.data for m in await asyncio.wait_for(fetch, 10)] == [b"first"]  # not 64, not 30 s
        await puller.close(0.0)


async def test_a_delivery_to_a_cancelled_fetch_is_a_leftover_to_hand_back(nats_url: str, prefix: str) -> None:
    """A fetch cancelled while its pull request waits at the server (a stop, a cancelled batch)
    leaves that request live: what it is delivered lands in the buffer. The next fetch returns it,
    or ``leftovers()`` hands it to a caller that naks it back to the queue at once."""
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        fetch = asyncio.ensure_future(puller.fetch(1, timeout=30.0))
        await pull_waiting(js, prefix.upper())
        fetch.cancel()
        await js.publish(f"{prefix}.q", b"late")  # type: ignore[attr-defined]

        async def buffered() -> bool:
            return puller.buffered == 1

        await wait_until(buffered, timeout_s=10, what="the late delivery in the puller's buffer")
        (msg,) = puller.leftovers()
        assert msg.data == b"late" and puller.buffered == 0
        await msg.nak()
        again = await puller.fetch(1, timeout=5.0)  # back in the queue, for any puller
        assert [m.data for m in again] == [b"late"] and again[0].metadata.num_delivered == 2


async def test_a_delivery_no_fetch_waits_for_is_told_as_late_and_one_a_fetch_waits_for_is_not(nats_url: str, prefix: str) -> None:
    """``on_late``: what a batch window waiting on arrival events hears of a request delivered
    to a request its fetch gave up on (no arrival event comes for it)."""
    nc, js = await _queue(nats_url, prefix)
    try:
        late: list[int] = []
        puller = await Puller(nc, prefix.upper(), "c", on_late=lambda: late.append(puller.buffered)).start()
        fetch = asyncio.ensure_future(puller.fetch(1, timeout=30.0))
        await pull_waiting(js, prefix.upper())
        fetch.cancel()  # its request still waits at the server
        await js.publish(f"{prefix}.q", b"late")  # type: ignore[attr-defined]
        await wait_until(lambda: late == [1], timeout_s=10, what="the late delivery told")
        assert [m.data for m in await puller.fetch(1, timeout=5.0)] == [b"late"]  # from the buffer
        await js.publish(f"{prefix}.q", b"fetched")  # type: ignore[attr-defined]
        assert [m.data for m in await puller.fetch(1, timeout=5.0)] == [b"fetched"]
        fill = asyncio.ensure_future(puller.fill(1, wait_s=30.0))
        await pull_waiting(js, prefix.upper())
        await js.publish(f"{prefix}.q", b"filled")  # type: ignore[attr-defined]
        assert [m.data for m in await fill] == [b"filled"]
        assert late == [1]  # neither delivery a fetch or a fill waited for was told
    finally:
        await nc.close()  # type: ignore[attr-defined]


async def test_a_fill_takes_what_is_stored_and_what_arrives_until_its_own_clock_ends_it(nats_url: str, prefix: str) -> None:
    """A batch window's last wait (the classifier's): what is stored comes at once, arrivals
    join while it waits, and it ends at its wait, on its own clock, not at the server's expiry.
    A batch already full needs no wait at all."""
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        await js.publish(f"{prefix}.q", b"stored")  # type: ignore[attr-defined]
        started = time.monotonic()
        fill = asyncio.ensure_future(puller.fill(3, 0.3))
        await pull_waiting(js, prefix.upper())  # stored one delivered, the request waits for 2 more
        await js.publish(f"{prefix}.q", b"arrived")  # type: ignore[attr-defined]
        got = await asyncio.wait_for(fill, 10)
        assert [m.data for m in got] == [b"stored", b"arrived"]
        assert time.monotonic() - started >= 0.3  # it waited on, for a third that never came
        for m in got:
            await m.ack()

        for i in range(4):
            await js.publish(f"{prefix}.q", str(i).encode())  # type: ignore[attr-defined]
        got = await asyncio.wait_for(puller.fill(4, 60.0), 10)  # full at once: not the 60 s wait
        assert [m.data for m in got] == [b"0", b"1", b"2", b"3"]
        for m in got:
            await m.ack()

        started = time.monotonic()
        assert await puller.fill(2, 0.05) == []
        assert time.monotonic() - started >= 0.05
        # Published just after the fill's end: delivered to its request (which ends half a
        # millisecond later) or left stored; the next fetch returns it either way.
        await js.publish(f"{prefix}.q", b"after")  # type: ignore[attr-defined]
        assert [m.data for m in await puller.fetch(1, timeout=5.0)] == [b"after"]
        await puller.unsubscribe()


async def test_a_stop_after_a_fill_hands_back_what_its_request_still_delivers(nats_url: str, prefix: str) -> None:
    """A fill returns while its pull request is still open at the server (it ends about a
    millisecond later). ``close`` waits for that end, so a request published as the window
    closed is either handed back (leftovers) or still stored: the next puller gets it at once,
    not after its ack wait (delivered to an inbox nobody listens on any more)."""
    nc, js = await _queue(nats_url, prefix)
    try:
        for i in range(5):
            puller = await Puller(nc, prefix.upper(), "c").start()
            await puller.fill(4, 0.003)
            await js.publish(f"{prefix}.q", f"late{i}".encode())  # type: ignore[attr-defined]
            for m in await puller.close(5.0):
                await m.nak()
            nxt = await Puller(nc, prefix.upper(), "c").start()
            got = await nxt.fetch(1, timeout=5.0)
            assert [m.data for m in got] == [f"late{i}".encode()]
            await got[0].ack()
            await nxt.unsubscribe()
    finally:
        await nc.close()  # type: ignore[attr-defined]


async def test_once_quiesced_a_request_stored_as_a_fill_ended_is_either_in_the_puller_or_pending(nats_url: str, prefix: str) -> None:
    """A fill returns on its own clock while its pull request is still open at the server. A
    count of the consumer taken then could miss a request that request delivers after the
    count's answer: in neither ``num_pending`` nor the puller. ``quiesce`` waits for every open
    request's end, so a count after it sees each request in one or the other."""
    async with _pulling(nats_url, prefix) as (nc, js, puller):
        for i in range(10):
            await puller.fill(4, 0.002)
            await js.publish(f"{prefix}.q", f"late{i}".encode())  # type: ignore[attr-defined]
            assert await puller.quiesce(5.0)
            info = await js.consumer_info(prefix.upper(), "c")  # type: ignore[attr-defined]
            assert puller.buffered + info.num_pending == 1
            got = await puller.fetch(1, timeout=5.0)
            assert [m.data for m in got] == [f"late{i}".encode()]
            await got[0].ack()
        assert await puller.quiesce(0.0)  # nothing open: at once
        # A request whose whole batch came gets no end from the server (its deliveries name
        # their stream subject, not the request): it is over all the same.
        for i in range(2):
            await js.publish(f"{prefix}.q", f"two{i}".encode())  # type: ignore[attr-defined]
        await wait_until(lambda: _pending(js, prefix, 2), timeout_s=5, what="two stored")
        got = await puller.fetch(2, timeout=5.0)
        assert len(got) == 2
        assert await puller.quiesce(0.0)
        await puller.unsubscribe()


async def _pending(js: object, prefix: str, n: int) -> bool:
    info = await js.consumer_info(prefix.upper(), "c")  # type: ignore[attr-defined]
    return bool(info.num_pending == n)


class _Consumer:
    """nats-server's side of one pull consumer, as a puller sees it, for the property below:
    waiting requests are served in turn (the one served goes to the back while it has room),
    what arrives with none waiting is stored and goes to the next request at once, and a
    request's end (408) says how many it still had. Deliveries name the stream subject and
    carry an ack subject."""

    def __init__(self) -> None:
        self.waiting: list[list[Any]] = []  # [reply subject, left], in the order served
        self.stored = 0
        self._cb: Any = None
        self._seq = 0

    def _delivery(self) -> Msg:
        self._seq += 1
        return Msg(None, subject="s.q", reply=f"$JS.ACK.S.c.1.{self._seq}.{self._seq}.1700000000000000000.0", data=b"m")  # type: ignore[arg-type]

    def new_inbox(self) -> str:
        return "_INBOX.p"

    async def subscribe(self, subject: str, cb: Any, pending_msgs_limit: int) -> Any:
        self._cb = cb
        return self

    async def unsubscribe(self) -> None:
        pass

    async def publish(self, subject: str, data: bytes, reply: str = "", headers: Any = None) -> None:
        body = json.loads(data)
        n = int(body["batch"])
        taken = min(n, self.stored)
        self.stored -= taken
        for _ in range(taken):
            await self._cb(self._delivery())
        if n > taken:
            self.waiting.append([reply, n - taken])

    async def arrive(self) -> None:
        if not self.waiting:
            self.stored += 1
            return
        request = self.waiting.pop(0)
        request[1] -= 1
        if request[1]:
            self.waiting.append(request)
        await self._cb(self._delivery())

    async def expire(self, i: int) -> None:
        reply, left = self.waiting.pop(i % len(self.waiting))
        await self._cb(Msg(None, subject=reply, headers={"Status": "408", "Nats-Pending-Messages": str(left)}))  # type: ignore[arg-type]


_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("fill"), st.integers(1, 6)),
        st.tuples(st.just("hold"), st.integers(1, 6)),
        st.tuples(st.just("arrive"), st.integers(1, 4)),
        st.tuples(st.just("expire"), st.integers(0, 5)),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(_STEPS)
# Two requests open, served in turn, the younger ending first: the older one looked filled.
@example([("fill", 2), ("fill", 3), ("arrive", 2), ("expire", 1)])
# The older ending first with more left than counted: the younger one had filled.
@example([("fill", 2), ("fill", 3), ("arrive", 2), ("expire", 0), ("hold", 1)])
# The same, three open: the one whose count is corrected is the one that had deliveries then.
@example([("fill", 2), ("fill", 3), ("arrive", 2), ("fill", 4)])
def test_the_puller_counts_a_request_open_while_the_server_has_it_open(steps: list[tuple[str, int]]) -> None:
    """Whatever the order of windows, holds, arrivals and ends (a delivery never says whose it
    is): the puller waits for a request (``quiesce``) exactly while the server holds one that
    can still deliver, and counts on none that cannot. Counted too few, a count of the consumer
    missed what came after it; too many, a hold waited on a request that had filled."""

    async def run() -> None:
        server = _Consumer()
        puller = await Puller(server, "S", "c").start()
        for op, k in steps:
            if op == "fill":
                await puller.fill(k, wait_s=0.0005, open_s=60.0)
            elif op == "hold":
                await puller.fetch(k, timeout=0.0005, hold_open_s=60.0)
            elif op == "arrive":
                for _ in range(k):
                    await server.arrive()
            elif server.waiting:
                await server.expire(k)
            can_deliver = any(left > 0 for _, left in server.waiting)
            assert await puller.quiesce(0.0) is not can_deliver, (op, k, server.waiting)
        while server.waiting:
            await server.expire(0)
        assert await puller.quiesce(0.0)

    asyncio.run(run())


def test_a_fill_asks_for_the_rest_when_a_request_it_counts_on_ends_early() -> None:
    """Found by a review: a fill waiting for what an open request brings (a hold's) before it
    asks for the rest waited out its whole window when that request ended early (a refusal, or
    an end the server sent sooner): it now asks for the rest at once. Against the model of the
    consumer above."""

    async def run() -> None:
        server = _Consumer()
        puller = await Puller(server, "S", "c").start()
        await server.arrive()  # stored: the hold's request takes it at once
        assert len(await puller.fetch(3, timeout=0.01, hold_open_s=60.0)) == 1  # 2 still to come
        fill = asyncio.ensure_future(puller.fill(3, wait_s=30.0))
        await asyncio.sleep(0)  # a yield, no time: the fill runs to its wait, counting on the hold's request for 2 of its 3
        assert [left for _, left in server.waiting] == [2]
        await server.expire(0)  # it ends early, with its 2 undelivered
        # The rest, asked for at once (without the fix, not before the fill's 30 s end).
        await wait_until(lambda: [left for _, left in server.waiting] == [3], timeout_s=5, what="the request for the rest")
        for _ in range(3):
            await server.arrive()
        assert len(await asyncio.wait_for(fill, 5)) == 3

    asyncio.run(run())
