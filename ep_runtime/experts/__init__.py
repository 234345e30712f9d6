"""Expert-compute backends: one module per backend, each registering itself in ``EXPERTS``.
Importing this package imports every module in it."""

from ep_runtime.registry import import_package_modules

import_package_modules(__name__, __path__)

from ep_runtime.experts.base import EXPERTS, Experts, ExpertsSetup  # noqa: E402

__all__ = ["EXPERTS", "Experts", "ExpertsSetup"]
