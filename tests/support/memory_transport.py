"""A transport written in the tests, in memory over the one-rank group: what a new transport
must implement is a class like ``InMemoryTransport`` (its capabilities and the four steps the
base class calls) and ``DISPATCHERS.register``. tests/dispatch/test_memory_transport.py runs the
multi-rank suite on it at W = 1; so does ``EP_TEST_BACKEND_MODULES=tests.support.memory_transport
EP_TEST_WORLD_SIZES=1 pytest tests/multigpu/test_suite.py -k in_memory``.
"""

from __future__ import annotations

import torch

from ep_runtime.dispatch.base import DISPATCHERS, Dispatcher
from ep_runtime.dispatch.protocol import Agreed
from ep_runtime.dispatch.setup import DispatcherCapabilities, DispatchSetup
from ep_runtime.kernels import Route
from ep_runtime.types import Dispatched, DispatchMode, TopkLayout

Held = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # x [T, H], ids [T, K], weights [T, K]


class InMemoryTransport(Dispatcher[Held, torch.Tensor, torch.Tensor]):
    """Rows stay where they are (a world of one): dispatch hands them to the experts (grouped
    by expert for EXPANDED); the reduction sums each token's results in fp32."""

    name = "in_memory_test"
    capabilities = DispatcherCapabilities(
        layouts=frozenset(TopkLayout),
        modes=frozenset(DispatchMode),
        device_types=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float32}),
    )
    auto_priority = -100  # only when named

    @classmethod
    def unavailable_reason(cls, setup: DispatchSetup) -> str | None:
        return "moves rows within one process only" if setup.comm.has_peers else None

    def _pack(self, x: torch.Tensor, topk_weights: torch.Tensor, route: Route) -> Held:
        return x, route.ids, torch.where(route.ids >= 0, topk_weights.float(), 0.0)

    def _exchange_dispatch(
        self, packed: Held, agreed: Agreed, layout: TopkLayout
    ) -> tuple[Dispatched, torch.Tensor]:
        """The handle: ``[T, J]`` int32 rows of the experts' output each token sums, -1 none."""
        x, ids, weights = packed
        if layout is TopkLayout.STANDARD:
            rows = torch.arange(ids.size(0), dtype=torch.int32, device=ids.device)
            served = torch.where((ids >= 0).any(1), rows, -1).unsqueeze(1)  # [T, 1]
            return Dispatched(x, ids, weights, layout, None), served
        local = self.placement.local
        grouped = self.ops.group_rows(
            x, ids, weights, local_offset=local.offset, num_local=local.count, num_rows=ids.numel()
        )
        ids, weights = grouped.ids.unsqueeze(1), grouped.weights.unsqueeze(1)
        return Dispatched(grouped.hidden, ids, weights, layout, grouped.offsets), grouped.positions

    def _exchange_combine(
        self,
        expert_output: torch.Tensor | None,
        dispatched: Dispatched,
        handle: torch.Tensor,
        status: torch.Tensor | None,
    ) -> tuple[torch.Tensor, None]:
        assert status is None, "alone: no peer needs this rank's status"
        if expert_output is None:  # this rank failed: zeros, as every transport sends
            expert_output = torch.zeros_like(dispatched.hidden_states)
        return expert_output, None

    def _reduce(
        self,
        returned: torch.Tensor,
        handle: torch.Tensor,
        out: torch.Tensor | None,
        failed: torch.Tensor | None,
    ) -> torch.Tensor:
        return self.ops.sum_rows(returned, handle, out, failed=failed)


def register() -> str:
    """Register the transport in this process (a rank's, or the suite's driver)."""
    DISPATCHERS.register(InMemoryTransport)
    return InMemoryTransport.name
