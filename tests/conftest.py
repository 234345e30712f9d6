"""Session-wide test settings, inherited by the spawned rank processes."""

from __future__ import annotations

import os

# Never start FlashInfer's CUTLASS JIT build (over 18 minutes) from a test: an unbuilt module
# is a refusal (skipped with its reason), even where a test names the backend.
os.environ.setdefault("EP_RUNTIME_FLASHINFER_CUTLASS_JIT", "0")
