"""A publish that finds no responder while the stream that should take it exists and captures its
subject is a stream briefly unavailable (a leader election, a restart), not an unknown model: the
client retries within its deadline. Against a real nats-server; no worker needed (the streams are
made here, a plain subscriber answers)."""

from __future__ import annotations

import re
from typing import Any

import nats.errors
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jetbatch import sdk
from jetbatch.sdk.protocol import Headers, Subjects, request_id_of, subject_matches

# --- the subject matcher -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("jb.model.m1", "jb.model.m1", True),
        ("jb.model.m1", "jb.model.m2", False),
        ("jb.model.m1", "jb.model.m1.x", False),
        ("jb.model.m1", "jb.model", False),
        ("jb.model.*", "jb.model.m1", True),
        ("jb.model.*", "jb.model", False),
        ("jb.model.*", "jb.model.m1.x", False),
        ("jb.*.m1", "jb.model.m1", True),
        ("*", "jb", True),
        ("*", "jb.in", False),
        ("jb.>", "jb.in", True),
        ("jb.>", "jb.in.acme.x", True),
        ("jb.>", "jb", False),
        (">", "jb", True),
        (">", "jb.in.acme", True),
        ("jb.*.>", "jb.in", False),
        ("jb.*.>", "jb.in.acme", True),
        ("jb.>.x", "jb.in.x", False),  # ">" only as the last token
        ("jb.model.m*", "jb.model.m1", False),  # a wildcard only as a whole token
        ("jb.model.m*", "jb.model.m*", True),
        ("jb.in", "jb.in.acme", False),
        ("jb.in.*", "jb.in", False),
    ],
)
def test_subject_matches_examples(pattern: str, subject: str, expected: bool) -> None:
    assert subject_matches(pattern, subject) is expected


_TOKENS = st.sampled_from(["a", "b", "c", "model", "m1"])
_SUBJECT = st.lists(_TOKENS, min_size=1, max_size=5)


def _oracle(pattern: list[str], subject: str) -> bool:
    """NATS matching as a regular expression (a reference, not the implementation)."""
    if ">" in pattern[:-1]:
        return False
    parts = [r"[^.]+" if t == "*" else r".+" if t == ">" else re.escape(t) for t in pattern]
    return re.fullmatch(r"\.".join(parts), subject) is not None


@given(
    pattern=st.lists(st.one_of(_TOKENS, st.just("*")), min_size=1, max_size=5),
    tail=st.booleans(),
    subject=_SUBJECT,
)
def test_subject_matches_agrees_with_a_regex_oracle(pattern: list[str], tail: bool, subject: list[str]) -> None:
    if tail:
        pattern = [*pattern, ">"]
    assert subject_matches(".".join(pattern), ".".join(subject)) is _oracle(pattern, ".".join(subject))


@given(subject=_SUBJECT, data=st.data())
def test_a_pattern_made_from_a_subject_captures_it_and_a_changed_token_does_not(subject: list[str], data: st.DataObject) -> None:
    stars = data.draw(st.lists(st.booleans(), min_size=len(subject), max_size=len(subject)))
    pattern = ["*" if star else token for token, star in zip(subject, stars)]
    text = ".".join(subject)
    assert subject_matches(".".join(pattern), text)
    cut = data.draw(st.integers(0, len(subject) - 1))
    assert subject_matches(".".join([*pattern[:cut], ">"]), text)  # ">" takes the rest (one or more)
    assert not subject_matches(".".join([*pattern, ">"]), text)  # ">" needs at least one more token
    assert not subject_matches(".".join([*pattern, "*"]), text)  # one token too many
    if len(pattern) > 1:
        assert not subject_matches(".".join(pattern[:-1]), text)  # one token too few
    literal = [i for i, star in enumerate(stars) if not star]
    if literal:
        i = data.draw(st.sampled_from(literal))
        changed = [*pattern[:i], pattern[i] + "x", *pattern[i + 1 :]]
        assert not subject_matches(".".join(changed), text)


# --- the decision, against a real server ---------------------------------------------------------


async def _models_stream(js: Any, subjects: Subjects, *models: str) -> None:
    await js.add_stream(name=subjects.models_stream, subjects=[subjects.model(m) for m in models])


async def _ingress_stream(js: Any, subjects: Subjects) -> None:
    await js.add_stream(name=subjects.ingress_stream, subjects=[subjects.ingress, subjects.tenant_ingress_wildcard])


async def _echo(nc: Any, subjects: Subjects, subject: str, tenant: str | None) -> Any:
    """A stand-in worker: answers each request on ``subject`` with its own payload."""

    async def answer(msg: Any) -> None:
        rid = request_id_of(msg.headers[Headers.MSG_ID], tenant)
        await nc.publish(
            subjects.answer(rid, msg.headers[Headers.REPLY_KEY], tenant),
            msg.data,
            headers={Headers.STATUS: "ok", Headers.CONTENT_TYPE: msg.headers[Headers.CONTENT_TYPE]},
        )

    return await nc.subscribe(subject, cb=answer)


class _Election:
    """Make ``client``'s publishes find no responder for the first ``unanswered`` careful attempts
    (every fast attempt finds none either), as while the stream's leader is being elected; the
    stream info the client asks for then is the real server's. Records each verdict of
    ``_no_stream_error``."""

    def __init__(self, client: sdk.Client, monkeypatch: pytest.MonkeyPatch, unanswered: int | None) -> None:
        self.unanswered = unanswered  # None: the election never ends
        self.refused = 0
        self.verdicts: list[sdk.JetbatchError | None] = []
        real_publish = client._js.publish
        real_verdict = client._no_stream_error

        async def no_fast_ack(*args: Any, **kwargs: Any) -> None:
            return None

        async def publish(*args: Any, **kwargs: Any) -> Any:
            if self.unanswered is None or self.refused < self.unanswered:
                self.refused += 1
                raise nats.errors.NoRespondersError
            return await real_publish(*args, **kwargs)

        async def verdict(*args: Any, **kwargs: Any) -> sdk.JetbatchError | None:
            answer = await real_verdict(*args, **kwargs)
            self.verdicts.append(answer)
            return answer

        monkeypatch.setattr(client, "_publish_once", no_fast_ack)
        monkeypatch.setattr(client._js, "publish", publish)
        monkeypatch.setattr(client, "_no_stream_error", verdict)


# (tenant, model): straight to a model's queue, through the classifier's ingress, and a tenant's
# request naming a model (it goes to the tenant's ingress subject, so the ingress stream decides).
_ROUTES = [(None, "m1"), (None, None), ("acme", "m1")]


async def _both_streams(client: sdk.Client) -> None:
    """The models stream (listing m1) and the ingress stream, as the sidecars make them."""
    await _models_stream(client.nats.jetstream(), client.subjects, "m1")
    await _ingress_stream(client.nats.jetstream(), client.subjects)


def _subject(subjects: Subjects, tenant: str | None, model: str | None) -> str:
    if tenant is not None:
        return subjects.tenant_ingress(tenant)
    return subjects.ingress if model is None else subjects.model(model)


@pytest.mark.anyio
@pytest.mark.parametrize(("tenant", "model"), _ROUTES)
async def test_no_responder_while_the_stream_captures_the_subject_is_retried_until_it_answers(
    nats_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch, tenant: str | None, model: str | None
) -> None:
    async with sdk.Client.connect(nats_url, prefix=prefix, tenant=tenant) as client:
        await _both_streams(client)
        sub = await _echo(client.nats, client.subjects, _subject(client.subjects, tenant, model), tenant)
        election = _Election(client, monkeypatch, unanswered=3)
        try:
            assert await client.infer(b"through the election", model=model, timeout=10) == b"through the election"
        finally:
            await sub.unsubscribe()
    assert election.refused == 3
    assert election.verdicts == [None, None, None]  # asked the real stream info each time: retry


@pytest.mark.anyio
@pytest.mark.parametrize(("tenant", "model"), _ROUTES)
async def test_no_responder_until_the_deadline_is_request_timeout_not_unknown_model(
    nats_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch, tenant: str | None, model: str | None
) -> None:
    async with sdk.Client.connect(nats_url, prefix=prefix, tenant=tenant) as client:
        await _both_streams(client)
        election = _Election(client, monkeypatch, unanswered=None)
        with pytest.raises(sdk.RequestTimeout, match="did not acknowledge"):
            await client.infer(b"never placed", model=model, timeout=1.0)
    assert election.refused >= 2
    assert election.verdicts and all(v is None for v in election.verdicts)


@pytest.mark.anyio
async def test_a_model_the_models_stream_does_not_list_is_unknown_model(nats_url: str, prefix: str) -> None:
    """The real no-responder path (nothing patched): the models stream exists without ``nope``."""
    async with sdk.Client.connect(nats_url, prefix=prefix) as client:
        await _models_stream(client.nats.jetstream(), client.subjects, "m1")
        with pytest.raises(sdk.UnknownModel, match="'nope'"):
            await client.infer(b"x", model="nope", timeout=5)


@pytest.mark.anyio
async def test_the_decision_against_real_streams(nats_url: str, prefix: str) -> None:
    async with sdk.Client.connect(nats_url, prefix=prefix) as client:
        js, subjects = client.nats.jetstream(), client.subjects
        decide = client._no_stream_error
        # No streams at all.
        assert isinstance(await decide(subjects.model("m1"), "m1", "r1"), sdk.StreamNotFound)
        assert isinstance(await decide(subjects.ingress, None, "r2"), sdk.StreamNotFound)
        assert isinstance(await decide(subjects.tenant_ingress("acme"), "m1", "r3"), sdk.StreamNotFound)
        await _models_stream(js, subjects, "m1", "m2")
        await _ingress_stream(js, subjects)
        # The stream captures the subject: unavailable, not missing.
        assert await decide(subjects.model("m1"), "m1", "r4") is None
        assert await decide(subjects.model("m2"), "m2", "r5") is None
        assert await decide(subjects.ingress, None, "r6") is None
        assert await decide(subjects.tenant_ingress("acme"), None, "r7") is None  # through "<prefix>.in.*"
        # A tenant's request naming a model goes to its ingress: the models stream is not asked.
        assert await decide(subjects.tenant_ingress("acme"), "m3", "r8") is None
        # The models stream does not list the model.
        unknown = await decide(subjects.model("m3"), "m3", "r9")
        assert isinstance(unknown, sdk.UnknownModel) and unknown.request_id == "r9"
