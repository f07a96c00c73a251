"""``handler = "transformers"``: a local Hugging Face ``save_pretrained`` directory (``pip install
'jetbatch[hf]'``). Nothing is downloaded: the directory is read with ``local_files_only``.

- ``path``: the directory (``config.json``, the weights, and the tokenizer's files when it has one).
  The model class is the one ``config.json`` names (``architectures``), else ``AutoModel``.
  A sentence-transformers directory (``modules.json``) is served as its encoder plus its pooling
  (mean or CLS, from ``1_Pooling/config.json``) and, when listed, normalisation.
- A request is a text (a string: the worker tokenizes the whole batch at once, padded to its
  longest, truncated to ``options.max_length``; a text longer than ``max_length`` times
  :data:`CHARS_PER_TOKEN` characters is cut before it is tokenized, and refused ``bad_request``
  when that prefix does not hold ``max_length`` tokens), or token ids as named tensors (``input_ids`` and
  optionally ``attention_mask``, padded the same way).
- The answer is the model's named outputs (``logits``, ``last_hidden_state`` cut to the
  request's own tokens, ...), a mapping of tensors; or, for a sentence-transformers directory or
  ``options.output = "embeddings"``, the pooled embedding (one tensor).

The weights are tiered like any module's (cold / warm / resident); see docs/handlers.md.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from .base import BadInput, HandlerError
from .modules import ModuleHandler
from .structure import batch_inputs, describe, split_output

__all__ = ["CHARS_PER_TOKEN", "TransformersHandler"]

# Characters of text kept per token of ``max_length`` before tokenizing: ordinary text spans about
# 4 characters a token, so the prefix holds every token truncation keeps, while a text of
# megabytes costs its tokenizer (memory and time, in every batch it joins) no more than this.
CHARS_PER_TOKEN = 32
# Tokens a cut prefix must hold past ``max_length``: the cut may split the last word it keeps.
_SPARE_TOKENS = 8
_WORD = re.compile(r"\S*")


class TransformersHandler(ModuleHandler):
    """A ``transformers`` model (and its tokenizer) from a local directory."""

    format = "transformers"

    def __init__(self, name: str, config: ModelConfig) -> None:
        super().__init__(name, config)
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise HandlerError(
                f"model {name}: the transformers handler needs the hf extra: pip install 'jetbatch[hf]'", key="handler"
            ) from None
        self.tokenizer: Any = None
        self._pooling: str | None = None  # "mean" or "cls": a sentence-transformers directory
        self._normalize = False
        output = self.options.get("output", "outputs")
        if output not in ("outputs", "embeddings"):
            raise HandlerError(f"model {name}: options.output must be 'outputs' or 'embeddings', got {output!r}", key="options")
        self._embeddings = output == "embeddings"
        self.max_length = int(self.options.get("max_length", 512))

    def check(self) -> None:
        p = Path(self.path)
        if not (p / "config.json").is_file():
            raise HandlerError(
                f"model {self.name}: {p.name} is not a save_pretrained directory (no config.json)",
                detail=f"model {self.name}: {self.path} is not a save_pretrained directory (no config.json)",
            )

    def _read(self) -> Any:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # a sidecar's log is not a terminal
        root = Path(self.path)
        modules = root / "modules.json"
        if modules.is_file():
            self._read_sentence_transformers(root, json.loads(modules.read_text()))
        arch = (json.loads((root / "config.json").read_text()).get("architectures") or [None])[0]
        # Embeddings come from the encoder itself (its last hidden state), not from a task head.
        cls = getattr(transformers, arch, None) if isinstance(arch, str) and not self._embeddings else None
        if cls is None:
            cls = transformers.AutoModel
        model = cls.from_pretrained(str(root), local_files_only=True)
        if any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(root), local_files_only=True)
        return model.eval()

    def _read_sentence_transformers(self, root: Path, modules: Any) -> None:
        kinds = [m.get("type", "") for m in modules if isinstance(m, dict)]
        self._embeddings = True
        self._normalize = any(k.endswith("Normalize") for k in kinds)
        self._pooling = "mean"
        for m in modules:
            if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling"):
                cfg_path = root / str(m.get("path", "")) / "config.json"
                if cfg_path.is_file() and json.loads(cfg_path.read_text()).get("pooling_mode_cls_token"):
                    self._pooling = "cls"

    def decode(self, data: bytes, content_type: str | None) -> Any:
        value = super(ModuleHandler, self).decode(data, content_type)  # the wire decoding, no tensor checks
        if isinstance(value, str):
            if self.tokenizer is None and self._host is not None:
                raise BadInput(f"model {self.name} has no tokenizer: send token ids (input_ids, attention_mask)")
            return self._bounded(value)
        if isinstance(value, Mapping) and "input_ids" in value and all(isinstance(v, torch.Tensor) for v in value.values()):
            if value["input_ids"].is_floating_point():
                raise BadInput(f"model {self.name}: input_ids must be integers, got {str(value['input_ids'].dtype).removeprefix('torch.')}")
            return dict(value)
        raise BadInput(f"model {self.name} expects a text (a string) or token ids (input_ids, attention_mask), got {describe(value)}")

    def _bounded(self, text: str) -> str:
        """``text``, or its prefix of at most ``max_length * CHARS_PER_TOKEN`` characters cut at a
        whitespace, which truncation turns into the same tokens; :class:`BadInput` when the prefix
        holds too few tokens to know that (a long run of spaces, or of one unknown word)."""
        limit = self.max_length * CHARS_PER_TOKEN
        if len(text) <= limit:
            return text
        cut = text[:limit]
        # Whole words only: a split word tokenizes differently. Matched on the reversed text, so
        # the cost is the last word's length whatever the text holds.
        whole = cut[: limit - _WORD.match(cut[::-1]).end()].rstrip()  # type: ignore[union-attr]
        cut = whole or cut  # one word of ``limit`` characters: kept as cut
        if self.tokenizer is not None:  # None only before the first load: the cut alone bounds it
            need = self.max_length + _SPARE_TOKENS
            ids = self.tokenizer(cut, add_special_tokens=False, truncation=True, max_length=need, verbose=False)["input_ids"]
            if len(ids) < need:
                raise BadInput(
                    f"model {self.name}: a text of {len(text)} characters holds fewer than {self.max_length} tokens "
                    f"in its first {limit}: it cannot be cut before tokenizing; send at most {limit} characters or token ids"
                )
        return cut

    def predict(self, inputs: list[Any]) -> list[Any]:
        model = self._host if self._resident else None
        if model is None:
            raise RuntimeError(f"model {self.name} is not loaded")
        texts = [x for x in inputs if isinstance(x, str)]
        if texts and len(texts) != len(inputs):
            # Texts and token ids in one batch: each kind in its own pass, answers in order.
            return [self.predict([x])[0] for x in inputs]
        with torch.inference_mode():
            if texts:
                if self.tokenizer is None:
                    raise RuntimeError(f"model {self.name} has no tokenizer")
                enc = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
                batch = {k: v.to(self.device) for k, v in enc.items()}
                lengths = [int(n) for n in enc["attention_mask"].sum(1)] if "attention_mask" in enc else None
            else:
                packed = batch_inputs(inputs, dtype=None, device=self.device, pad=True, pad_value=float(self._pad_id()), mask_name="attention_mask")
                if packed is None:
                    if len(inputs) == 1:
                        raise RuntimeError(f"model {self.name} cannot run {describe(inputs[0])}")
                    # Different names, or shapes padding cannot join: one pass each.
                    return [self.predict([x])[0] for x in inputs]
                batch = packed.value
                lengths = packed.lengths
                if "attention_mask" not in batch:
                    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
            out = model(**batch)
            if self._embeddings:
                return list(self._pool(out, batch["attention_mask"]).cpu().unbind(0))
            return split_output(dict(out), len(inputs), lengths if lengths is not None and len(set(lengths)) > 1 else None)

    def _pool(self, out: Any, mask: torch.Tensor) -> torch.Tensor:
        hidden = out["last_hidden_state"] if isinstance(out, Mapping) and "last_hidden_state" in out else out[0]
        if self._pooling == "cls":
            pooled = hidden[:, 0]
        else:
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1) if self._normalize else pooled

    def _pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None) if self.tokenizer is not None else None
        return int(pad) if pad is not None else 0

    def _example(self) -> Any:
        if self.tokenizer is not None:
            return "hello"
        return {"input_ids": torch.ones(4, dtype=torch.int64), "attention_mask": torch.ones(4, dtype=torch.int64)}

    def _input_spec(self, module: Any) -> Any:
        return None  # texts or token ids of any length: checked in decode

