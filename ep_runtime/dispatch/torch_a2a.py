"""torch.distributed ``all_to_all_single`` dispatcher (gloo on CPU, NCCL on GPU).

The packed-row transport of ``rows.py`` over plain all-to-alls: per forward a fixed-size header
exchange, the dispatch rows and the combine rows (three collectives; none in a world of one).
Runs anywhere torch.distributed does, at any world size.
"""

from __future__ import annotations

import torch

from ep_runtime.dispatch.base import DISPATCHERS
from ep_runtime.dispatch.rows import RowDispatcher
from ep_runtime.dispatch.setup import DispatcherCapabilities
from ep_runtime.types import DispatchMode, TopkLayout


@DISPATCHERS.register
class TorchAllToAll(RowDispatcher):
    """The portable dispatcher."""

    name = "torch_a2a"
    capabilities = DispatcherCapabilities(
        layouts=frozenset(TopkLayout),
        modes=frozenset(DispatchMode),
        device_types=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float32}),
        graph_capturable=True,
        rebuilds_on_new_group=True,
    )
    auto_priority = 0
