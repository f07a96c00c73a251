"""What padding costs for text of different lengths: the share of padded positions when a batch
of sentences is tokenized together (padded to its longest), and the forward-pass time of one
padded batch against one pass per sentence, on the example Hugging Face model
(examples/huggingface). Needs `pip install 'jetbatch[hf]'`. Run:

    python -m bench.models.padding [--batch 32] [--rounds 20] [--min-words 4] [--max-words 12]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from jetbatch.sidecar.config import ModelConfig
from jetbatch.sidecar.handlers import create_handler

from bench import harness
from examples.huggingface.build import WORDS, build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--min-words", type=int, default=4)
    parser.add_argument("--max-words", type=int, default=12)
    parser.add_argument("--json", default=None, help="append the run's record to this file (one JSON object per line)")
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        handler = create_handler("text", ModelConfig(handler="transformers", path=str(build(Path(tmp) / "m"))))
        handler.load(torch.device("cpu"))
        padded_share, batched_s, one_by_one_s = [], [], []
        for _ in range(args.rounds):
            texts = [" ".join(rng.choices(WORDS, k=rng.randint(args.min_words, args.max_words))) for _ in range(args.batch)]
            enc = handler.tokenizer(texts, padding=True)
            real = sum(sum(m) for m in enc["attention_mask"])
            padded_share.append(1 - real / (len(texts) * len(enc["attention_mask"][0])))
            started = time.perf_counter()
            handler.predict(texts)
            batched_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            for text in texts:
                handler.predict([text])
            one_by_one_s.append(time.perf_counter() - started)
    harness.emit(
        {
            "bench": "padding", "batch": args.batch, "words": [args.min_words, args.max_words],
            "padded_share_median": statistics.median(padded_share),
            "padded_batch_ms_median": statistics.median(batched_s) * 1000,
            "one_pass_each_ms_median": statistics.median(one_by_one_s) * 1000,
            "padded_over_one_by_one": statistics.median(batched_s) / statistics.median(one_by_one_s),
        },
        args.json,
    )  # fmt: skip


if __name__ == "__main__":
    main()
