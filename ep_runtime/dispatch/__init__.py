"""All-to-all backends. Importing this package registers every backend in ``DISPATCHERS``."""

from ep_runtime.dispatch import deepep_v2, torch_a2a, torch_symm_mem  # noqa: F401
from ep_runtime.dispatch.base import DISPATCHERS, Dispatcher, DispatchSetup

__all__ = ["DISPATCHERS", "DispatchSetup", "Dispatcher"]
