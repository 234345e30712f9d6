"""All-to-all backends: one module per backend, each registering itself in ``DISPATCHERS``.
Importing this package imports every module in it."""

from ep_runtime.registry import import_package_modules

import_package_modules(__name__, __path__)

from ep_runtime.dispatch.base import DISPATCHERS, Dispatcher  # noqa: E402
from ep_runtime.dispatch.setup import DispatchSetup  # noqa: E402

__all__ = ["DISPATCHERS", "DispatchSetup", "Dispatcher"]
