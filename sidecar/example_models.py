"""Small, real example models, built locally with fixed seeds (nothing is downloaded).

Three TorchScript models take a 16-dimensional float vector; a classifier network, trained here
on synthetic data, tells which of them a vector belongs to. ``jetbatch examples build`` writes
them with a ready ``models.toml`` (worker) and ``classifier.toml`` (classifier).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["EXAMPLE_MODELS", "INPUT_DIM", "ExampleSet", "build_examples", "sample_inputs"]

INPUT_DIM = 16
# name -> (hidden width, output dim): different sizes give different load costs.
EXAMPLE_MODELS: dict[str, tuple[int, int]] = {"sentiment": (256, 3), "topic": (1024, 8), "spam": (64, 2)}
_SEED = 20261202


@dataclass(frozen=True)
class ExampleSet:
    directory: Path
    models_toml: Path
    classifier_toml: Path
    up_toml: Path


def _centers() -> torch.Tensor:
    """One well-separated cluster centre per example model: the classifier's ground truth."""
    gen = torch.Generator().manual_seed(_SEED)
    return torch.randn(len(EXAMPLE_MODELS), INPUT_DIM, generator=gen) * 3.0


def sample_inputs(n: int, *, seed: int = 0) -> tuple[torch.Tensor, list[str]]:
    """``n`` vectors drawn around the clusters, and the model each belongs to."""
    gen = torch.Generator().manual_seed(seed)
    names = list(EXAMPLE_MODELS)
    labels = torch.randint(len(names), (n,), generator=gen)
    x = _centers()[labels] + torch.randn(n, INPUT_DIM, generator=gen) * 0.5
    return x, [names[i] for i in labels.tolist()]


def _script(module: torch.nn.Module, path: Path) -> None:
    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is deprecated upstream
        torch.jit.save(torch.jit.script(module), str(path))


def _train_router(steps: int = 200) -> torch.nn.Module:
    torch.manual_seed(_SEED)
    net = torch.nn.Sequential(torch.nn.Linear(INPUT_DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, len(EXAMPLE_MODELS)))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    names = list(EXAMPLE_MODELS)
    for step in range(steps):
        x, labels = sample_inputs(128, seed=step)
        y = torch.tensor([names.index(m) for m in labels])
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net


def build_examples(directory: str | Path, *, force: bool = False) -> ExampleSet:
    """Build (or reuse) the example models and configs under ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stamp = out / ".built"
    if force or not stamp.exists():
        with torch.no_grad():
            for i, (name, (hidden, classes)) in enumerate(EXAMPLE_MODELS.items()):
                torch.manual_seed(_SEED + i)
                model = torch.nn.Sequential(
                    torch.nn.Linear(INPUT_DIM, hidden),
                    torch.nn.ReLU(),
                    torch.nn.Linear(hidden, hidden),
                    torch.nn.ReLU(),
                    torch.nn.Linear(hidden, classes),
                    torch.nn.Softmax(dim=-1),
                )
                _script(model, out / f"{name}.pt")
        _script(_train_router(), out / "router.pt")
        stamp.write_text("ok\n")
    models = "\n".join(
        f'[models.{name}]\nhandler = "torchscript"\npath = "{name}.pt"\nmax_batch_size = 16\nmax_delay_ms = 10\n'
        f"load_cost_s = 0.05\nmax_wait_ms = 1000\n"
        for name in EXAMPLE_MODELS
    )
    labels = "\n".join(f'"{i}" = "{name}"' for i, name in enumerate(EXAMPLE_MODELS))
    classifier = (
        '[classifier]\nrouter = "torch"\nhandler = "torchscript"\npath = "router.pt"\n'
        f'max_batch_size = 64\nmax_delay_ms = 5\nconfidence_threshold = 0.5\nfallback_model = "{next(iter(EXAMPLE_MODELS))}"\n'
        f"\n[classifier.labels]\n{labels}\n"
    )
    worker = '[worker]\nmax_resident_models = 1\n\n'
    (out / "models.toml").write_text(worker + models)
    (out / "classifier.toml").write_text(classifier)
    (out / "up.toml").write_text(worker + models + "\n" + classifier)
    return ExampleSet(out, out / "models.toml", out / "classifier.toml", out / "up.toml")
