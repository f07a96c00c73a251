"""Small, real example models, built locally with fixed seeds (nothing is downloaded).

Three models take a 16-dimensional float vector; a classifier network, trained here on synthetic
data, tells which of them a vector belongs to. They are saved in the formats teams ship today:
``sentiment``, ``topic`` and the router as ``torch.export`` programs (``.pt2``, dynamic batch
dimension), ``spam`` as a safetensors state dict of :class:`ExampleMLP`. ``jetbatch examples
build`` writes them with a ready ``models.toml`` (worker) and ``classifier.toml`` (classifier).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["EXAMPLE_MODELS", "INPUT_DIM", "ExampleMLP", "ExampleSet", "build_examples", "sample_inputs"]

INPUT_DIM = 16
# name -> (hidden width, output dim, format): different sizes give different load costs.
EXAMPLE_MODELS: dict[str, tuple[int, int, str]] = {
    "sentiment": (256, 3, "export"),
    "topic": (1024, 8, "export"),
    "spam": (64, 2, "state_dict"),
}
_SEED = 20261202
_FORMAT_VERSION = "2"  # bump when the files change, so old builds are rebuilt


class ExampleMLP(torch.nn.Module):
    """The example models' architecture: two hidden layers and a softmax over ``classes``."""

    def __init__(self, hidden: int, classes: int, input_dim: int = INPUT_DIM) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(input_dim, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, classes),
            torch.nn.Softmax(dim=-1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


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


def export_program(module: torch.nn.Module, path: Path, *, input_dim: int = INPUT_DIM, max_batch: int = 4096) -> None:
    """Save ``module`` as a ``torch.export`` program batched on a dynamic first dimension."""
    module.eval()
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    program = torch.export.export(module, (torch.zeros(2, input_dim),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))


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


def _model_file(name: str, fmt: str) -> str:
    return f"{name}.pt2" if fmt == "export" else f"{name}.safetensors"


def build_examples(directory: str | Path, *, force: bool = False) -> ExampleSet:
    """Build (or reuse) the example models and configs under ``directory``."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stamp = out / ".built"
    if force or not stamp.exists() or stamp.read_text().strip() != _FORMAT_VERSION:
        for i, (name, (hidden, classes, fmt)) in enumerate(EXAMPLE_MODELS.items()):
            torch.manual_seed(_SEED + i)
            model = ExampleMLP(hidden, classes).eval()
            if fmt == "export":
                export_program(model, out / _model_file(name, fmt))
            else:
                save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / _model_file(name, fmt)))
        export_program(_train_router(), out / "router.pt2")
        stamp.write_text(_FORMAT_VERSION + "\n")
    models = "\n".join(_model_toml(name, hidden, classes, fmt) for name, (hidden, classes, fmt) in EXAMPLE_MODELS.items())
    labels = "\n".join(f'"{i}" = "{name}"' for i, name in enumerate(EXAMPLE_MODELS))
    classifier = (
        '[classifier]\nrouter = "torch"\nhandler = "export"\npath = "router.pt2"\n'
        f'max_batch_size = 64\nmax_delay_s = 0.005\nconfidence_threshold = 0.5\nfallback_model = "{next(iter(EXAMPLE_MODELS))}"\n'
        f"\n[classifier.labels]\n{labels}\n"
    )
    worker = "[worker]\nmax_resident_models = 1\n\n"
    (out / "models.toml").write_text(worker + models)
    (out / "classifier.toml").write_text(classifier)
    (out / "up.toml").write_text(worker + models + "\n" + classifier)
    return ExampleSet(out, out / "models.toml", out / "classifier.toml", out / "up.toml")


def _model_toml(name: str, hidden: int, classes: int, fmt: str) -> str:
    lines = [f"[models.{name}]", f'handler = "{fmt}"', f'path = "{_model_file(name, fmt)}"']
    if fmt == "state_dict":
        lines += ['module_class = "jetbatch.sidecar.dev.example_models:ExampleMLP"', f"module_kwargs = {{ hidden = {hidden}, classes = {classes} }}", f"options = {{ input_shape = [{INPUT_DIM}] }}"]
    lines += ["max_batch_size = 16", "max_delay_s = 0.01", "load_cost_s = 0.05", "max_wait_s = 1.0", ""]
    return "\n".join(lines)
