"""``jetbatch dlq``: list, show, replay and purge dead letters. No torch needed.

Dead letters live in the ``<prefix>_DLQ`` stream, subject ``<prefix>.dlq.<stage>``, with the
original payload and headers plus ``Jetbatch-Dlq-Reason``, ``-Stage``, ``-Subject`` and
``-Deliveries``. Replay republishes the original message to its original subject under its
original request id, with a message id of its own (``<id>.replay-<seq>``: JetStream would drop the
original id as a duplicate within its window), and removes the dead letter only once JetStream
stored the republish as a new message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass
from typing import Any


from jetbatch.sdk import failures
from jetbatch.sdk.connection import connect_nats
from jetbatch.sdk.protocol import Headers, Priority, ProtocolError, Subjects, forwardable_headers, replay_id

from ..errors import TRANSPORT_ERRORS
from ._common import EXIT_FAILED, CliError, add_json, add_nats_url, add_prefix, plain, shown



def register(sub: Any) -> None:
    p = sub.add_parser("dlq", help="inspect, replay or purge dead letters", description=plain(__doc__.split("\n\n")[0]))
    p.add_argument("action", choices=["list", "show", "replay", "purge"], help="list | show SEQ | replay SEQ or --all | purge")
    p.add_argument("seq", nargs="?", type=int, help="dead-letter sequence number (show, replay)")
    p.add_argument("--all", action="store_true", help="replay every dead letter")
    p.add_argument("--yes", "-y", action="store_true", help="purge without asking")
    add_nats_url(p)
    add_prefix(p)
    add_json(p, "list: one dead letter per line; show: the letter, as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "show" and args.seq is None:
        raise CliError("show needs a sequence number (see `jetbatch dlq list`)")
    if args.action == "replay" and args.seq is None and not args.all:
        raise CliError("replay needs a sequence number or --all")
    if args.action == "purge" and not args.yes:
        if not sys.stdin.isatty():
            raise CliError("purge deletes every dead letter: pass --yes (no terminal to ask on)")
        answer = input("delete every dead letter? [y/N] ").strip().lower()
        if answer not in ("y", "yes"):
            print("not purged")
            return EXIT_FAILED
    return asyncio.run(_run(args))


@dataclass(frozen=True)
class _Letter:
    """One dead letter as read: its headers as text (``unreadable``: those that were not UTF-8)."""

    seq: int
    data: bytes
    headers: dict[str, str]
    unreadable: list[str]


async def _entries(js: Any, subjects: Subjects) -> list[_Letter]:
    info = await js.stream_info(subjects.dead_letter_stream)
    out: list[_Letter] = []
    seq = info.state.first_seq
    while seq and seq <= info.state.last_seq:
        try:
            msg = await js.get_msg(subjects.dead_letter_stream, seq=seq, next=True, subject=subjects.dead_letter_wildcard)
        except failures.NOT_FOUND:
            break
        headers, unreadable = _readable_headers(msg.headers)
        out.append(_Letter(seq=msg.seq, data=msg.data or b"", headers=headers, unreadable=unreadable))
        seq = msg.seq + 1
    return out


def _readable_headers(headers: Any) -> tuple[dict[str, str], list[str]]:
    """A dead letter's headers as text, and the names of those that were not UTF-8. nats-py reads
    a stored message's headers with the email parser, which gives such a value as a ``Header``
    object, not a string: a letter copied from a producer's request whose header held other bytes
    broke every listing and replay. Such a value is shown with replacement characters and left
    off a replay (its bytes cannot be sent again as they were)."""
    text: dict[str, str] = {}
    unreadable: list[str] = []
    for name, value in (headers or {}).items():
        if isinstance(value, str):
            text[str(name)] = value
            continue
        unreadable.append(str(name))
        try:
            text[str(name)] = str(value)
        except Exception:  # noqa: BLE001 - a header object that cannot be shown is shown as nothing
            text[str(name)] = ""
    return text, unreadable


def _summary(msg: _Letter) -> dict[str, Any]:
    h = msg.headers or {}
    return {
        "seq": msg.seq,
        "stage": h.get(Headers.DLQ_STAGE, ""),
        "request_id": h.get(Headers.REQUEST_ID, ""),
        "subject": h.get(Headers.DLQ_SUBJECT, ""),
        "deliveries": _count(h.get(Headers.DLQ_DELIVERIES, "")),
        "reason": h.get(Headers.DLQ_REASON, ""),
        "bytes": len(msg.data or b""),
    }


def _count(text: str) -> int | None:
    """A delivery count header as a number; None when it is not one (the header is data anyone
    who can publish to the stream wrote)."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 20 else None


def _letters(n: int) -> str:
    """``n dead letter(s)``, in agreement."""
    return f"{n} dead letter" if n == 1 else f"{n} dead letters"


def _print_letter(letter: dict[str, Any]) -> None:
    """One dead letter as lines for a person: its fields, headers and the payload's start."""
    print(f"dead letter {letter['seq']}")
    for key, label in (("stage", "stage"), ("request_id", "request id"), ("subject", "subject"), ("deliveries", "deliveries"), ("reason", "reason")):
        value = letter[key]
        print(f"  {label:<11} {'' if value is None else shown(value)}")
    print(f"  {'payload':<11} {letter['bytes']} bytes: {shown(letter['payload_preview'])}")
    print("  headers")
    for name, value in letter["headers"].items():
        print(f"    {shown(name)}: {shown(value)}")


async def _run(args: argparse.Namespace) -> int:
    subjects = Subjects(args.prefix)
    nc = await connect_nats(args.nats_url)
    try:
        js = nc.jetstream()
        try:
            entries = await _entries(js, subjects)
        except failures.NOT_FOUND:
            raise CliError(f"no dead-letter stream {subjects.dead_letter_stream} on this server") from None
        if args.action == "list":
            rows = [_summary(m) for m in entries]
            if args.json:
                for row in rows:
                    print(json.dumps(row))
            elif not rows:
                print("no dead letters")
            else:
                print(f"{'seq':>6}  {'stage':<10} {'request id':<34} {'deliveries':>10}  reason")
                for r in rows:
                    deliveries = "" if r["deliveries"] is None else r["deliveries"]
                    print(f"{r['seq']:>6}  {shown(r['stage']):<10} {shown(r['request_id'])[:33]:<34} {deliveries:>10}  {shown(r['reason'])}")
            return 0
        if args.action == "purge":
            await js.purge_stream(subjects.dead_letter_stream)
            print(f"purged {_letters(len(entries))}")
            return 0
        chosen = entries if args.all else [m for m in entries if m.seq == args.seq]
        if not chosen and args.all:
            print("no dead letters")  # nothing to replay: done
            return 0
        if not chosen:
            raise CliError(f"no dead letter with sequence {args.seq}")
        if args.action == "show":
            m = chosen[0]
            letter = {**_summary(m), "headers": dict(m.headers or {}), "payload_preview": (m.data or b"")[:200].decode("utf-8", "replace")}
            if args.json:
                print(json.dumps(letter))
            else:
                _print_letter(letter)
            return 0
        replayed = 0
        for m in chosen:
            h = forwardable_headers(m.headers)  # older dead letters may hold a producer's Nats-*
            for name in m.unreadable:
                h.pop(name, None)
                print(f"jetbatch dlq: dead letter {m.seq}: header {shown(name)[:64]} is not UTF-8; replayed without it", file=sys.stderr)
            # The letter's own headers, in every spelling (a crafted `jetbatch-dlq-subject` was
            # sent on into the queue): taken off all, the canonical one's value read first.
            subject = _take(h, Headers.DLQ_SUBJECT)
            for key in (Headers.DLQ_REASON, Headers.DLQ_STAGE, Headers.DLQ_DELIVERIES):
                _take(h, key)
            rid = _take(h, Headers.REQUEST_ID)
            if rid:
                h[Headers.MSG_ID] = replay_id(rid, m.seq)
            if not subject:
                print(f"jetbatch dlq: dead letter {m.seq} has no original subject; skipped", file=sys.stderr)
                continue
            if not _replayable(subjects, subject):
                # The header is data in a stream: never let it aim the operator's credentials
                # anywhere but the deployment's own queues (a forged letter aimed at $JS.API...).
                print(f"jetbatch dlq: dead letter {m.seq} names {subject[:80]!r}, not a queue of this deployment; skipped", file=sys.stderr)
                continue
            try:
                ack = await js.publish(subject, m.data or b"", headers=h, timeout=5)
            except TRANSPORT_ERRORS as exc:
                print(f"jetbatch dlq: replay of {m.seq} to {subject} failed: {exc!r}", file=sys.stderr)
                continue
            except (ValueError, TypeError, AttributeError, UnicodeError) as exc:
                # Headers nats-py will not write (a name that is no token, a line break in a
                # value): this letter stays, the others are still replayed.
                print(f"jetbatch dlq: dead letter {m.seq} cannot be sent again as stored: {shown(exc)[:200]}; skipped", file=sys.stderr)
                continue
            if ack.duplicate:
                # JetStream kept an earlier copy under this id and dropped this one: deleting the
                # letter now would lose the request if that copy is gone.
                print(f"jetbatch dlq: dead letter {m.seq} was not queued again: JetStream took it for a duplicate of {shown(h.get(Headers.MSG_ID, ''))[:80]} (replayed within the stream's duplicate window); letter kept", file=sys.stderr)
                continue
            await js.delete_msg(subjects.dead_letter_stream, m.seq)
            replayed += 1
        print(f"replayed {_letters(replayed)}" if replayed == len(chosen) else f"replayed {replayed} of {_letters(len(chosen))}")
        return 0 if replayed == len(chosen) else EXIT_FAILED
    finally:
        await nc.close()


def _take(headers: dict[str, str], name: str) -> str:
    """Remove ``name`` from ``headers`` in every case it is spelt in; its value (the canonical
    spelling's first), or ""."""
    spellings = [k for k in headers if k.lower() == name.lower()]
    values = [headers.pop(k) for k in sorted(spellings, key=lambda k: k != name)]
    return values[0] if values else ""


def _replayable(subjects: Subjects, subject: str) -> bool:
    """Whether a dead letter's original subject is one of the deployment's request queues: a
    model queue, the ingress, or a tenant's ingress."""
    if subject == subjects.ingress:
        return True
    tenant, model = subjects.tenant_from_subject(subject), subjects.model_from_subject(subject)
    try:
        if tenant is not None:
            return subject == subjects.tenant_ingress(tenant)
        return model is not None and subject in (subjects.model(model, p) for p in Priority)
    except ProtocolError:  # not one token, or not a valid name
        return False
