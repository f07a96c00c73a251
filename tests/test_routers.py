"""The classifier's routers on their own (no broker): one producer's bad input never fails the
others' requests in the same batch."""

from __future__ import annotations

from typing import Any, Iterator

import msgspec
import pytest
import torch

from jetbatch.sdk.protocol import ErrorCode, Tensor, encode_payload
from jetbatch.sidecar.classifier.routers import Item, TorchRouter
from jetbatch.sidecar.config import ClassifierConfig
from tests.classifier_fixtures import PairNet

LABELS = {"0": "m0", "1": "m1"}


def router(**options: Any) -> TorchRouter:
    cfg = msgspec.convert({"router": "torch", "handler": "tests.classifier_fixtures:PairNet", "labels": LABELS, **options}, ClassifierConfig)
    r = TorchRouter(cfg)
    r.load()
    return r


def tensor_item(t: Tensor) -> Item:
    data, ctype = encode_payload(t)
    return Item(headers={}, data=data, content_type=ctype.value)


def good(first: float) -> Item:
    return tensor_item(Tensor.from_torch(torch.tensor([first, 0.0])))


@pytest.fixture(autouse=True)
def working_net() -> Iterator[None]:
    PairNet.fail = False
    yield
    PairNet.fail = False


HOSTILE = {
    "wrong width": Tensor.from_torch(torch.ones(3)),
    "wrong rank": Tensor.from_torch(torch.ones(2, 2)),
    "empty": Tensor.from_torch(torch.ones(0)),
    "overflowing shape": Tensor(dtype="float32", shape=(2**64 - 1, 0), data=b""),
    # 2.7 KB: its element count, printed, was past Python's 4 300 digits (ValueError, the batch failed).
    "300 huge dimensions": Tensor(dtype="float32", shape=(2**64 - 1,) * 300, data=b""),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_tensor_fails_alone(kind: str) -> None:
    """8 valid requests and one hostile one in a batch: the 8 are routed, the one is bad_request
    (it was the whole batch's bad_request or internal error, the 8 terminated with it)."""
    items = [good(1.0 if i % 2 else -1.0) for i in range(8)]
    items.insert(3, tensor_item(HOSTILE[kind]))
    routes = router().route(items)
    assert routes[3].model is None and routes[3].error is not None and routes[3].error[0] is ErrorCode.BAD_REQUEST, routes[3]
    others = routes[:3] + routes[4:]
    assert [r.model for r in others] == ["m0", "m1", "m0", "m1", "m0", "m1", "m0", "m1"]
    assert "Traceback" not in routes[3].error[1] and "\n" not in routes[3].error[1]


def test_a_configured_input_shape_is_checked_before_the_forward_pass() -> None:
    routes = router(input_shape=[2]).route([good(1.0), tensor_item(HOSTILE["wrong width"])])
    assert routes[0].model == "m1"
    assert routes[1].error is not None and routes[1].error[0] is ErrorCode.BAD_REQUEST
    assert "expects input shape [2], got [3]" in routes[1].error[1]


def test_a_router_failing_on_a_shape_it_took_before_is_the_router_s_fault() -> None:
    """A broken network must not be passed off as every caller's bad input (bad_request ends
    the message for good): it is `internal`, for this batch only."""
    r = router()
    assert [x.model for x in r.route([good(1.0)])] == ["m1"]
    PairNet.fail = True
    routes = r.route([good(1.0), good(-1.0)])
    assert all(x.error is not None and x.error[0] is ErrorCode.INTERNAL for x in routes), routes
    PairNet.fail = False
    assert [x.model for x in r.route([good(1.0)])] == ["m1"]


def test_a_router_that_never_worked_does_not_blame_the_inputs() -> None:
    """After a restart nothing has been classified yet: a failing first batch (a transient
    error, a broken network) is `internal`, not every caller's `bad_request`."""
    PairNet.fail = True
    routes = router().route([good(1.0), good(-1.0)])
    assert all(x.error is not None and x.error[0] is ErrorCode.INTERNAL for x in routes), routes


def test_an_input_that_fails_where_others_of_its_shape_pass_fails_alone() -> None:
    """A value-dependent failure (an out-of-range id, here a huge value) in a batch of valid
    inputs of the same shape: the pass is retried input by input, and only that one is refused."""
    r = router()
    items = [good(1.0 if i % 2 else -1.0) for i in range(7)]
    items.insert(2, good(5000.0))
    routes = r.route(items)
    assert routes[2].error is not None and routes[2].error[0] is ErrorCode.BAD_REQUEST, routes[2]
    assert [x.model for x in routes[:2] + routes[3:]] == ["m0", "m1", "m0", "m1", "m0", "m1", "m0"]


def test_non_finite_inputs_are_refused() -> None:
    nan = tensor_item(Tensor.from_torch(torch.tensor([float("nan"), 0.0])))
    routes = router().route([nan, good(1.0)])
    assert routes[0].error is not None and routes[0].error[0] is ErrorCode.BAD_REQUEST and "NaN" in routes[0].error[1]
    assert routes[1].model == "m1"


def test_an_exported_router_knows_its_input_shape_from_the_first_request(examples_dir: Any) -> None:
    """The example router is a torch.export program: its input shape is read from the program,
    and it is warmed up at load, so the very first odd tensor after a start is the input's fault
    (it was `internal`, with an ERROR line, until some batch had succeeded)."""
    cfg = msgspec.convert({"router": "torch", "handler": "export", "path": str(examples_dir / "router.pt2"), "labels": {"0": "a", "1": "b", "2": "c"}}, ClassifierConfig)
    r = TorchRouter(cfg)
    r.load()
    assert r.input_shape == (16,)
    zero_d = tensor_item(Tensor.from_torch(torch.tensor(1.0)))
    routes = r.route([zero_d, tensor_item(Tensor.from_torch(torch.zeros(16)))])
    assert routes[0].error is not None and routes[0].error[0] is ErrorCode.BAD_REQUEST and "expects input shape [16], got []" in routes[0].error[1]
    assert routes[1].model in ("a", "b", "c")


def test_a_torchscript_router_still_loads_without_an_input_shape(tmp_path: Any) -> None:
    """Reading an input shape from a torch.export program must not touch other formats (a
    TorchScript module's graph is another kind of object: the classifier could not start)."""
    path = tmp_path / "router.pt"
    torch.jit.script(PairNet().linear).save(str(path))  # the same two-class layer, scripted
    cfg = msgspec.convert({"router": "torch", "handler": "torchscript", "path": str(path), "labels": LABELS}, ClassifierConfig)
    r = TorchRouter(cfg)
    r.load()
    assert r.input_shape is None
    assert [x.model for x in r.route([good(1.0), good(-1.0)])] == ["m1", "m0"]


def test_a_network_for_one_input_at_a_time_is_run_that_way() -> None:
    r = router(handler="tests.classifier_fixtures:SingleNet")
    first = r.route([good(1.0), good(-1.0), good(1.0)])
    assert [x.model for x in first] == ["m1", "m0", "m1"]
    calls: list[int] = []
    forward = r._forward
    r._forward = lambda tensors: calls.append(len(tensors)) or forward(tensors)  # type: ignore[method-assign]
    assert [x.model for x in r.route([good(-1.0), good(1.0)])] == ["m0", "m1"]
    assert calls == [1, 1]  # learnt: no doomed batch pass first


def test_non_finite_scores_take_the_fallback_or_are_internal() -> None:
    with_fallback = router(handler="tests.classifier_fixtures:InfNet", fallback_model="m0", confidence_threshold=0.0)
    assert [x.model for x in with_fallback.route([good(1.0)])] == ["m0"]
    without = router(handler="tests.classifier_fixtures:InfNet").route([good(1.0)])
    assert without[0].error is not None and without[0].error[0] is ErrorCode.INTERNAL


def test_header_rules_route_on_the_loop_and_field_rules_and_networks_in_a_thread() -> None:
    """A thread hop a batch cost the classifier more than header lookups do; a rule that decodes
    payloads, or a network, must not stop the loop on a large batch."""
    from jetbatch.sidecar.classifier.routers import RulesRouter

    def rules(*rules: dict[str, Any]) -> RulesRouter:
        return RulesRouter(msgspec.convert({"router": "rules", "rules": list(rules), "default_model": "m0"}, ClassifierConfig))

    assert rules().inline
    headers = rules({"header": "X-Kind", "equals": "a", "model": "m1"})
    assert headers.inline
    assert [r.model for r in headers.route([Item(headers={"X-Kind": "a"}, data=b"", content_type=None)])] == ["m1"]
    assert not rules({"header": "X-Kind", "equals": "a", "model": "m1"}, {"field": "kind", "equals": "b", "model": "m1"}).inline
    assert not router().inline


def test_a_payload_nested_too_deep_is_its_own_bad_request_not_its_batchs_failure() -> None:
    """Found by an attack: msgspec raises RecursionError on a deeply nested body, which
    ``decode_payload`` let through, so a field rule failed the whole batch (every tenant's
    request in it answered ``internal``). It is now that request's ``bad_request``."""
    from jetbatch.sidecar.classifier.routers import RulesRouter

    router_ = RulesRouter(msgspec.convert(
        {"router": "rules", "rules": [{"field": "kind", "equals": "b", "model": "m1"}], "default_model": "m0"}, ClassifierConfig,
    ))  # fmt: skip
    deep = b"\x91" * 100_000 + b"\xc0"
    batch = [Item(headers={}, data=msgspec.msgpack.encode({"kind": "b"}), content_type="application/msgpack"),
             Item(headers={}, data=deep, content_type="application/msgpack"),
             Item(headers={}, data=b"[" * 100_000 + b"]" * 100_000, content_type="application/json"),
             Item(headers={}, data=msgspec.msgpack.encode({"kind": "a"}), content_type="application/msgpack")]  # fmt: skip
    routed = router_.route(batch)
    assert [r.model for r in routed] == ["m1", None, None, "m0"]
    assert [r.error[0] if r.error else None for r in routed] == [None, ErrorCode.BAD_REQUEST, ErrorCode.BAD_REQUEST, None]


def test_a_field_rule_fails_only_the_request_whose_tensor_cannot_be_read() -> None:
    """Found by an attack: a tensor body whose shape made decoding raise something other than
    ProtocolError failed a rules router's whole batch (every innocent request ``internal``)."""
    from jetbatch.sidecar.classifier.routers import RulesRouter

    router_ = RulesRouter(msgspec.convert(
        {"router": "rules", "rules": [{"field": "kind", "equals": "b", "model": "m1"}], "default_model": "m0"}, ClassifierConfig,
    ))  # fmt: skip
    poison = msgspec.msgpack.encode({"dtype": "float32", "shape": [2**64 - 1] * 300, "data": b""})
    batch = [Item(headers={}, data=msgspec.msgpack.encode({"kind": "b"}), content_type="application/msgpack"),
             Item(headers={}, data=poison, content_type="application/vnd.jetbatch.tensor+msgpack"),
             Item(headers={}, data=msgspec.msgpack.encode({"kind": "a"}), content_type="application/msgpack")]  # fmt: skip
    routed = router_.route(batch)
    assert [r.model for r in routed] == ["m1", None, "m0"]
    assert routed[1].error is not None and routed[1].error[0] is ErrorCode.BAD_REQUEST and "at most 64" in routed[1].error[1]


def test_json_and_msgpack_lists_are_routed_as_model_subjects_take_them() -> None:
    """A list of numbers is what a model subject accepts (as float32): the torch router takes it
    too, in the same batch as tensors, and checks it like a tensor (shape, finite values); a list
    that is not numbers is that request's bad_request."""

    def listed(value: Any, ctype: str) -> Item:
        data = msgspec.json.encode(value) if ctype == "application/json" else msgspec.msgpack.encode(value)
        return Item(headers={}, data=data, content_type=ctype)

    items = [
        listed([1.0, 0.0], "application/json"),
        listed([-1, 0], "application/msgpack"),
        good(1.0),
        listed([1.0, 0.0, 3.0], "application/json"),
        listed([[1.0], [2.0, 3.0]], "application/json"),
        listed(["a", "b"], "application/msgpack"),
        listed([1e300, 0.0], "application/json"),
        listed({"x": [1.0, 0.0]}, "application/json"),
    ]
    routes = router(input_shape=[2]).route(items)
    assert [r.model for r in routes[:3]] == ["m1", "m0", "m1"]
    codes = [r.error[0] if r.error else None for r in routes[3:]]
    assert codes == [ErrorCode.BAD_REQUEST] * 5, routes
    messages = [r.error[1] for r in routes[3:] if r.error]
    assert "expects input shape [2], got [3]" in messages[0]
    assert "list of numbers" in messages[1] and "list of numbers" in messages[2]
    assert "infinity" in messages[3] and "got dict" in messages[4]
