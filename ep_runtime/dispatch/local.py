"""The world-of-one transport: nothing moves, so nothing is packed or copied.

Alone, every expert is this rank's, so the rows the experts read are the caller's own ``x``
(with fp8 experts, its ``q(x)``: e4m3 values and per-128-column scales, one launch) and the
ids are the route's checked ones. STANDARD hands those over as they are; EXPANDED regroups
them by expert as the packed-row transport does. Combine writes the experts' results (EXPANDED:
each token's local rows summed in fp32; STANDARD: the rows of the tokens the route sent) straight
into the output. The forward protocol around it is the base class's: the route checks the ids,
the header and the failure path run as at any world size. So it computes what the packed-row
transport computes (bit for bit wherever the experts take the same tile configs: the packed rows
hand them a header row more) with two launches fewer (the pack and the local-id map; EXPANDED:
the pack and the second reduction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_runtime.dispatch.base import DISPATCHERS, Dispatcher
from ep_runtime.dispatch.protocol import Agreed
from ep_runtime.dispatch.rows import group_for_experts
from ep_runtime.dispatch.setup import DispatcherCapabilities, DispatchSetup, PeerSetup
from ep_runtime.kernels import Route
from ep_runtime.kernels.layout import RowFormat
from ep_runtime.types import Dispatched, DispatchMode, TopkLayout


@dataclass(frozen=True)
class LocalPacked:
    rows: torch.Tensor  # [T, H] x, or [T, ≥ payload bytes] uint8 q(x) and its scales (fp8)
    route: Route  # ids: [T, K] int32 checked ids, -1 = unused
    weights: torch.Tensor  # [T, K] fp32


@dataclass(frozen=True)
class LocalHandle:
    sent: torch.Tensor  # [T, 1] int32 the route's dest_slot: -1 = the token goes nowhere
    grouped_positions: torch.Tensor | None  # EXPANDED: [T, K] int32 grouped row of each slot


@DISPATCHERS.register
class LocalDispatcher(Dispatcher[LocalPacked, LocalHandle, torch.Tensor]):
    """A world of one: the experts read the caller's rows; ``"auto"`` tries it before every
    transport there (nothing to move beats moving it), on CPU and CUDA alike."""

    name = "local"
    capabilities = DispatcherCapabilities(
        layouts=frozenset(TopkLayout),
        modes=frozenset(DispatchMode),
        device_types=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float32}),
        max_world_size=1,
        graph_capturable=True,
        rebuilds_on_new_group=True,
    )
    auto_priority = 20  # above deepep_v2's 10: at a world of one nothing needs a transport

    def __init__(self, setup: DispatchSetup, peer_setup: PeerSetup) -> None:
        super().__init__(setup, peer_setup)
        self.local = self.placement.local
        # fp8: one token's q(x) and scales side by side, as the packed rows carry them
        self.row_format = RowFormat(
            setup.hidden_size,
            setup.dtype,
            setup.max_top_k,
            quantized=setup.quantization is not None,
        )
        self.payload_row_bytes = -(-self.row_format.payload_bytes // 16) * 16  # aligned rows

    def _pack(self, x: torch.Tensor, topk_weights: torch.Tensor, route: Route) -> LocalPacked:
        """Nothing to pack: fp8 experts get ``q(x)`` (and its scales), others ``x`` itself."""
        rows = x
        if self.row_format.quantized:
            rows = torch.empty(
                x.size(0), self.payload_row_bytes, dtype=torch.uint8, device=x.device
            )
            columns_contiguous = x if x.stride(1) == 1 else x.contiguous()
            hidden, scales = self.row_format.hidden(rows), self.row_format.scales(rows)
            self.ops.quantize_rows(columns_contiguous, hidden, scales)
        return LocalPacked(rows, route, topk_weights.float())

    def _exchange_dispatch(
        self, packed: LocalPacked, agreed: Agreed, layout: TopkLayout
    ) -> tuple[Dispatched, LocalHandle]:
        ids, sent = packed.route.ids, packed.route.dest_slot
        if layout is TopkLayout.EXPANDED:
            rows = packed.rows
            payload = self.row_format.payload_words(rows) if self.row_format.quantized else rows
            dispatched, positions = group_for_experts(
                self.ops,
                self.row_format,
                payload,
                ids,
                packed.weights,
                self.local,
                rows.size(0) * min(agreed.top_k, self.local.count),  # every pair may be served
                self.setup.poison,
            )
            return dispatched, LocalHandle(sent, positions)
        hidden, scale = packed.rows, None
        if self.row_format.quantized:
            hidden, scale = self.row_format.hidden(hidden), self.row_format.scales(hidden)
        dispatched = Dispatched(
            hidden, ids, packed.weights, layout, None, hidden_states_scale=scale
        )
        return dispatched, LocalHandle(sent, None)

    def _exchange_combine(
        self,
        expert_output: torch.Tensor | None,
        dispatched: Dispatched,
        handle: LocalHandle,
        status: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """No peer to send to: the results stay where they are (zeros after a failure)."""
        if expert_output is None:
            rows = dispatched.hidden_states.size(0)
            expert_output = torch.zeros(
                rows, self.setup.hidden_size, dtype=self.setup.dtype, device=self.comm.device
            )
        return expert_output, None

    def _reduce(
        self,
        returned: torch.Tensor,  # STANDARD [T, H]; EXPANDED [N, H] grouped rows
        handle: LocalHandle,
        out: torch.Tensor | None,
        failed: torch.Tensor | None,
    ) -> torch.Tensor:
        """Into ``out`` in one launch: EXPANDED sums each token's grouped rows in fp32;
        STANDARD's rows are already each token's sum, read only for the tokens the route sent
        (the experts may leave the others' rows as anything: they are zero, as a token sent
        nowhere is in the packed-row transport). NaN everywhere if the forward failed."""
        if handle.grouped_positions is not None:
            return self.ops.sum_rows(returned, handle.grouped_positions, out, failed=failed)
        return self.ops.sum_rows(returned, handle.sent, out, failed=failed, own_rows=True)
