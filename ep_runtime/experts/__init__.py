"""Expert-compute backends. Importing this package registers every backend in ``EXPERTS``."""

from ep_runtime.experts import grouped_mm, reference  # noqa: F401
from ep_runtime.experts.base import EXPERTS, Experts, ExpertsSetup

__all__ = ["EXPERTS", "Experts", "ExpertsSetup"]
