"""jetbatch: model-affinity batching for many PyTorch models on one GPU, on NATS JetStream.

- :mod:`jetbatch.sdk`: the producer client (nats-py, msgspec, opentelemetry-api; no torch).
- :mod:`jetbatch.sidecar`: the worker and classifier sidecars and the ``jetbatch`` command.
"""

import os as _os

__version__ = "0.2.0"
__all__ = ["__version__"]

# The repository keeps sdk/ and sidecar/ at its top; installed wheels carry them inside this
# package. In a source checkout (an editable install, the tests) the subpackages are found beside
# this folder.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "sdk")) and _os.path.isfile(_os.path.join(_root, "sdk", "__init__.py")):
    __path__.append(_root)  # type: ignore[name-defined]  # noqa: F821
