"""The classifier sidecar: routes requests from ``<prefix>.in`` (and ``<prefix>.in.<tenant>``) to
``<prefix>.model.<name>``.

- :mod:`.service`: the :class:`Classifier` (pull in batches, route, republish, answer errors).
- :mod:`.routers`: torch network, rules and callable routers.
"""

from .routers import CallableRouter, Item, Route, Router, RulesRouter, TorchRouter, make_router
from .service import Classifier

__all__ = ["CallableRouter", "Classifier", "Item", "Route", "Router", "RulesRouter", "TorchRouter", "make_router"]
