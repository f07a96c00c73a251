"""The `transformers` handler against models built here from a config with a fixed seed (nothing
downloaded): text in, named outputs or embeddings out, equal to the model run in this process."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from jetbatch import sdk
from jetbatch.sidecar.dev.deployment import Deployment
from tests.helpers import make_config, running_worker

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["a great movie", "this film was not good at all", "boring", "the story was fun and the actor was good"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from examples.huggingface.build import build

    return build(tmp_path_factory.mktemp("hf") / "sentiment")


def _reference(directory: Path, texts: list[str]) -> tuple[Any, Any]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    classifier = transformers.BertForSequenceClassification.from_pretrained(str(directory), local_files_only=True).eval()
    encoder = transformers.AutoModel.from_pretrained(str(directory), local_files_only=True).eval()
    logits, pooled = [], []
    with torch.inference_mode():
        for text in texts:  # each alone: no padding
            enc = tokenizer(text, return_tensors="pt")
            logits.append(classifier(**enc).logits[0])
            hidden = encoder(**enc).last_hidden_state[0]
            pooled.append(hidden.mean(0))
    return logits, pooled


def test_text_through_the_classifier_to_a_hugging_face_model(hf_dir: Path, nats_server: Any, tmp_path: Path) -> None:
    """examples/huggingface/jetbatch.toml as shipped (but for its model path and subject prefix):
    texts without a model go through the classifier to the worker, tokenized together in one
    padded batch, and each answer's logits equal the model's on that text alone."""
    text = (ROOT / "examples" / "huggingface" / "jetbatch.toml").read_text()
    text = text.replace('path = "model"', f'path = "{hf_dir}"').replace("[worker]", '[nats]\nprefix = "hfx"\n\n[worker]', 1)
    config = tmp_path / "jetbatch.toml"
    config.write_text(text)
    expected, _ = _reference(hf_dir, TEXTS)

    async def ask(url: str) -> list[sdk.Result]:
        async with sdk.Client.connect(url, prefix="hfx") as client:
            return await asyncio.gather(*(client.infer_result(t, timeout=60) for t in TEXTS))

    with Deployment(config, nats_url=nats_server.url) as dep:
        results = asyncio.run(ask(dep.url))
    for result, want in zip(results, expected):
        assert result.batch.model == "sentiment"
        assert isinstance(result.output, dict) and set(result.output) == {"logits"}
        torch.testing.assert_close(result.output["logits"].to_torch(), want, atol=1e-5, rtol=1e-4)
    assert max(r.batch.batch_size for r in results) > 1  # texts of different lengths shared a pass


@pytest.mark.anyio
async def test_embeddings_and_a_sentence_transformers_directory(hf_dir: Path, nats_url: str, prefix: str, tmp_path: Path) -> None:
    st = tmp_path / "st"
    shutil.copytree(hf_dir, st)
    (st / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))  # fmt: skip
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}))
    models = {
        "emb": {"handler": "transformers", "path": str(hf_dir), "options": {"output": "embeddings"}},
        "st": {"handler": "transformers", "path": str(st)},
    }
    _, pooled = _reference(hf_dir, TEXTS)
    async with running_worker(make_config(prefix, models, worker={"max_resident_models": 2}), nats_url):
        async with sdk.Client.connect(nats_url, prefix=prefix) as client:
            mean = await asyncio.gather(*(client.infer(t, model="emb", timeout=60) for t in TEXTS))
            normalized = await asyncio.gather(*(client.infer(t, model="st", timeout=60) for t in TEXTS))
            # Token ids instead of text: the same embedding.
            import transformers

            tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
            ids = tokenizer(TEXTS[1], return_tensors="pt")
            by_ids = await client.infer({"input_ids": ids["input_ids"][0], "attention_mask": ids["attention_mask"][0]}, model="emb", timeout=60)
            with pytest.raises(sdk.BadRequest, match="expects a text"):
                await client.infer(torch.zeros(4), model="emb", timeout=60)
    for got, want in zip(mean, pooled):
        torch.testing.assert_close(got.to_torch(), want, atol=1e-5, rtol=1e-4)
    for got, want in zip(normalized, pooled):
        torch.testing.assert_close(got.to_torch(), torch.nn.functional.normalize(want, dim=-1), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(by_ids.to_torch(), pooled[1], atol=1e-5, rtol=1e-4)


class _Spy:
    """A tokenizer that records the longest text it is given."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.longest = 0

    def __call__(self, texts: Any, **kwargs: Any) -> Any:
        self.longest = max([self.longest, *(len(t) for t in ([texts] if isinstance(texts, str) else texts))])
        return self.tokenizer(texts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def test_a_text_of_megabytes_is_cut_before_it_is_tokenized(hf_dir: Path) -> None:
    """A 7 MB text reaches the tokenizer as a prefix of at most max_length * CHARS_PER_TOKEN
    characters, and is answered as its truncation would be (the logits of a short text with the
    same first tokens); a text whose prefix holds too few tokens to know that is a BadInput."""
    from jetbatch.sidecar.config import ModelConfig
    from jetbatch.sidecar.handlers import BadInput, create_handler
    from jetbatch.sidecar.handlers.huggingface import CHARS_PER_TOKEN

    h = create_handler("hf", ModelConfig(handler="transformers", path=str(hf_dir), options={"max_length": 16}))
    h.load(torch.device("cpu"))
    spy = _Spy(h.tokenizer)
    h.tokenizer = spy
    ctype = sdk.ContentType.MSGPACK.value
    phrase = "the story was fun and the actor was good but the plot "
    huge = phrase * (7_000_000 // len(phrase))
    value = h.decode(sdk.protocol.encode_payload(huge)[0], ctype)
    assert isinstance(value, str) and huge.startswith(value) and len(value) <= 16 * CHARS_PER_TOKEN
    short = phrase * 3  # more than 16 tokens: truncated the same
    got_huge, got_short = h.predict([value]), h.predict([short])
    assert spy.longest <= 16 * CHARS_PER_TOKEN
    torch.testing.assert_close(got_huge[0]["logits"], got_short[0]["logits"])
    # A short text is given whole; a long run of spaces before the words cannot be cut safely.
    assert h.decode(sdk.protocol.encode_payload(short)[0], ctype) == short
    with pytest.raises(BadInput, match="fewer than 16 tokens"):
        h.decode(sdk.protocol.encode_payload(" " * 2_000_000 + phrase)[0], ctype)
    assert spy.longest <= 16 * CHARS_PER_TOKEN
