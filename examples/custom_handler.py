"""A custom handler to copy: a model defined in Python, loaded on the worker's device.

In models.toml:

    [models.scaler]
    handler = "examples.custom_handler:ScaleHandler"
    options = { factor = 3.0 }
"""

from __future__ import annotations

from typing import Any

import torch

from jetbatch.sdk.protocol import ContentType
from jetbatch.sidecar.handlers import BadInput, Handler, tensor_bytes


class ScaleHandler(Handler):
    """Multiplies each input vector by a learned-free scale in one batched forward pass."""

    def load(self, device: torch.device) -> None:
        # Build (or torch.load) the module here; the worker calls load() in a thread.
        factor = float(self.options.get("factor", 2.0))
        self.module = torch.nn.Linear(1, 1, bias=False).to(device)
        with torch.no_grad():
            self.module.weight.fill_(factor)
        self.device = device

    def unload(self) -> None:
        self.module = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def memory_bytes(self) -> int:
        return tensor_bytes(self.module) if getattr(self, "module", None) is not None else 0

    def decode(self, data: bytes, content_type: str | None) -> Any:
        value = super().decode(data, content_type)  # tensors arrive as (read-only) torch tensors
        if isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
            value = torch.tensor(value, dtype=torch.float32)  # also accept a JSON/msgpack list
        if not isinstance(value, torch.Tensor) or value.dim() != 1:
            raise BadInput("expected a 1-d tensor or a list of numbers")
        return value

    def predict(self, inputs: list[Any]) -> list[Any]:
        lengths = [len(x) for x in inputs]
        flat = torch.cat(inputs).to(self.device, torch.float32).unsqueeze(1)  # one forward pass for the batch
        with torch.inference_mode():
            out = self.module(flat).squeeze(1).cpu()
        return list(out.split(lengths))

    def encode(self, output: Any) -> tuple[bytes, ContentType]:
        return super().encode(output)
