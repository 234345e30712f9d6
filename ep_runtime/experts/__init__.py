"""Expert-compute backends. Importing this package registers every backend in ``EXPERTS``."""

from ep_runtime.experts import (  # noqa: F401
    flashinfer_cutlass,
    flashinfer_trtllm,
    grouped_mm,
    reference,
)
from ep_runtime.experts.base import EXPERTS, Experts, ExpertsSetup

__all__ = ["EXPERTS", "Experts", "ExpertsSetup"]
