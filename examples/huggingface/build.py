"""A tiny Hugging Face text classifier, built here with a fixed seed (nothing is downloaded), and
saved as a ``save_pretrained`` directory with its tokenizer: what `jetbatch`'s `transformers`
handler serves. Real checkpoints work the same way: point `path` at their directory.

    python -m examples.huggingface.build .jetbatch/hf     # then: jetbatch up --config examples/huggingface/jetbatch.toml
"""

from __future__ import annotations

import sys
from pathlib import Path

WORDS = (
    "the a an this that movie film book story plot actor was is were are very really quite not "
    "good great fine bad awful boring fun loved hated liked enjoyed okay and but so it of"
).split()
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def build(directory: str | Path, *, seed: int = 0) -> Path:
    """Write the model and its tokenizer under ``directory`` (created); returns it."""
    import torch
    import transformers
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    transformers.utils.logging.disable_progress_bar()

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(out / "vocab.txt"), do_lower_case=True)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, num_labels=len(LABELS), id2label=LABELS, label2id={v: k for k, v in LABELS.items()},
    )  # fmt: skip
    BertForSequenceClassification(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else ".jetbatch/hf"))
