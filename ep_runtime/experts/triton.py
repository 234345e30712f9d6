"""Our own fused Triton experts: two grouped GEMMs over the dispatcher's rows, nothing between.

STANDARD (preferred): the served (row, slot) pairs are sorted by expert as indices only
(``experts/gemm/expert_rows.py``); GEMM1 gathers each pair's hidden state straight from the received
rows and applies the activation in its epilogue; GEMM2 applies the router weight in its epilogue
and writes the pair's row; one fixed-order pass sums each row's slots. EXPANDED: the same GEMMs
on the dispatcher's grouped rows (GEMM2 writes each row's own result, padding rows zero). Four
launches (STANDARD) or two (EXPANDED), fp32 math, one rounding per step, no atomics.

Tile configs come from the tuned table shipped in the package (``experts/gemm/expert_tiles.json``,
written by ``python -m ep_runtime.bench.tune_experts``) or a heuristic, resolved per rows-per-
expert bucket once and cached; buffers grow to the largest forward seen and are reused.

On CPU it runs only under Triton's interpreter (``TRITON_INTERPRET=1``: slow, for tests), and
``"auto"`` picks it only where it was measured faster than ``grouped_mm``: SM90, at most 512
tokens per rank (decode-sized layers).

With fp8 block-scaled weights (``quantization="fp8_block"``) the same four (two) launches run
the fp8 GEMMs of ``experts/gemm/expert_gemm_fp8.py`` on ``q(x)``: the dispatched e4m3 rows and their
scales as they arrive (fp8 dispatch), else one more launch quantizes the rows first
(``kernels/fp8_quant.py``). GEMM1's epilogue writes ``q(act)`` for GEMM2; the output is the
compute dtype.
"""

from __future__ import annotations

import os
from fractions import Fraction
from typing import ClassVar

import torch

from ep_runtime.experts.base import (
    EXPERTS,
    Experts,
    ExpertsCapabilities,
    ExpertsSetup,
    WorkBuffers,
    cuda_arch,
    quantized_rows,
)
from ep_runtime.experts.gemm.expert_gemm import expert_down, expert_up
from ep_runtime.experts.gemm.expert_gemm_fp8 import expert_down_fp8, expert_up_fp8
from ep_runtime.experts.gemm.expert_rows import sort_pairs, sum_slots
from ep_runtime.experts.gemm.expert_tiles import GemmTiles, TileConfig, rows_bucket, select
from ep_runtime.kernels.triton_common import HAS_TRITON
from ep_runtime.quantization import BLOCK, FP8_DTYPE, Fp8BlockWeights, Quantization
from ep_runtime.types import Activation, Dispatched, TopkLayout

INTERPRET_ENV = "TRITON_INTERPRET"


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors)."""
    return os.environ.get(INTERPRET_ENV, "0").lower() in ("1", "true", "on")


@EXPERTS.register
class TritonExperts(Experts):
    name = "triton"
    capabilities = ExpertsCapabilities(
        device_types=frozenset({"cpu", "cuda"}),  # cpu: under the interpreter only
        dtypes=frozenset({torch.bfloat16, torch.float32}),
        activations=frozenset(Activation),
        layouts=frozenset(TopkLayout),
        preferred_layout=TopkLayout.STANDARD,
        quantizations=frozenset({None, Quantization.FP8_BLOCK}),
        graph_capturable=True,
        serves_given_weights=True,
        description="Triton grouped GEMMs: rows gathered in GEMM1, router weight in GEMM2 "
        "(fp8 block scales: applied per 128-deep k-step)",
    )
    auto_priority = 15
    # where "auto" may pick it: measured faster than grouped_mm on the H200 (BENCHMARKS.md) at
    # T ≤ 512 tokens per rank, eager and as a CUDA graph; at T = 4096 (prefill) it was slower on
    # the DeepSeek-V3 shard (H 7168) and as fast or faster on Qwen3-30B-A3B (H 2048, two runs of
    # 2026-12-02): at H ≤ 2048 any cap
    measured_archs: ClassVar[frozenset[int]] = frozenset({90})
    auto_max_tokens_per_rank: ClassVar[int] = 512
    auto_any_cap_max_hidden: ClassVar[int] = 2048

    @classmethod
    def unavailable_reason(cls, setup: ExpertsSetup) -> str | None:
        if setup.device.type == "cpu" and not interpreting():
            return f"runs on CPU only under Triton's interpreter ({INTERPRET_ENV}=1)"
        if not HAS_TRITON:
            return "triton is not installed"
        arch = cuda_arch(setup.device)
        if arch is not None and arch < 80:
            return f"needs SM80+ (bf16 tensor cores), this device is SM{arch}"
        if setup.config.quantization is not None and arch is not None and arch < 89:
            return f"fp8 block scales need SM89+ (e4m3 tensor cores), this device is SM{arch}"
        return None

    @classmethod
    def auto_refusal(cls, setup: ExpertsSetup) -> str | None:
        if setup.device.type == "cpu":
            return "on CPU it runs in Triton's interpreter (slow, for tests): name it to use it"
        arch = cuda_arch(setup.device)
        if arch not in cls.measured_archs:
            return f"measured faster than grouped_mm on SM90 only, not on SM{arch}"
        hidden = setup.config.hidden_size
        if setup.config.quantization is not None:
            return None  # grouped_mm, the rule's other side, has no fp8 path
        if setup.token_cap > cls.auto_max_tokens_per_rank and hidden > cls.auto_any_cap_max_hidden:
            return (
                f"measured faster than grouped_mm up to {cls.auto_max_tokens_per_rank} tokens "
                f"per rank (any cap at hidden ≤ {cls.auto_any_cap_max_hidden}), not at a cap of "
                f"{setup.token_cap} with hidden {hidden} (prefill: grouped_mm was faster)"
            )
        return None

    def __init__(self, setup: ExpertsSetup) -> None:
        super().__init__(setup)
        self.fp8: Fp8BlockWeights | None = None
        self.gated = self.activation.is_gated
        self.num_local = self.placement.num_local_experts
        self.local_offset = self.placement.local_expert_offset
        self.hidden = self.config.hidden_size
        self.intermediate = self.config.intermediate_size
        device = setup.device
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.interpret = device.type == "cpu"
        self._configs: dict[Fraction, GemmTiles] = {}  # by rows-per-expert bucket
        self.buffers = WorkBuffers(device)
        self._offsets = torch.zeros(self.num_local + 1, dtype=torch.int32, device=device)

    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13 = w13.contiguous()  # [L, 2I | I, H]
        self.w2 = w2.contiguous()  # [L, H, I]

    def load_quantized_weights(self, weights: Fp8BlockWeights) -> None:
        self.fp8 = weights  # e4m3 and fp32 block scales, contiguous (Fp8BlockWeights.to)

    def workspace_bytes(self, max_rows: int) -> int:
        """STANDARD at K = top_k: pair indices, the activation, the per-pair results and the
        output; EXPANDED needs less (no pairs, no per-pair results)."""
        pairs = max_rows * self.config.top_k
        element = self.setup.dtype.itemsize
        if self.config.quantization is None:
            activation = element * pairs * self.intermediate
            quantized_rows = 0
        else:  # e4m3 act and its scales; the rows quantized here when they arrive unquantized
            activation = pairs * (self.intermediate + self.intermediate // BLOCK * 4)
            quantized_rows = max_rows * (self.hidden + self.hidden // BLOCK * 4)
        return (
            4 * (pairs + self.num_local + 1)
            + activation
            + element * pairs * self.hidden
            + element * max_rows * self.hidden
            + quantized_rows
        )

    def release_workspace(self) -> None:
        self.buffers.clear()

    def _tile_configs(self, served_pairs: int) -> GemmTiles:
        """The two GEMMs' tile configs for about ``served_pairs`` grouped rows (cached per
        rows-per-expert bucket)."""
        bucket = rows_bucket(served_pairs, self.num_local)
        configs = self._configs.get(bucket)
        if configs is None:

            def pick(gemm: str, n: int, k: int, gated: bool) -> TileConfig:
                return select(
                    self.device_name, gemm, self.num_local, n, k, gated, served_pairs,
                    fp8=self.fp8 is not None, interpret=self.interpret,
                )  # fmt: skip

            configs = GemmTiles(
                up=pick("up", self.intermediate, self.hidden, self.gated),
                down=pick("down", self.hidden, self.intermediate, False),
            )
            self._configs[bucket] = configs
        return configs

    def _up(
        self,
        dispatched: Dispatched,
        offsets: torch.Tensor,  # [L + 1] int32
        pairs: torch.Tensor | None,  # [P] int32 (STANDARD) or None (EXPANDED)
        num_grouped: int,  # P
        top_k: int,
        config: TileConfig,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """GEMM1 into reused buffers: ``act [P, I]`` (bf16 path) or ``(q(act) [P, I] e4m3,
        scales [P, I/128] fp32)`` (fp8 path)."""
        if self.fp8 is None:
            act = self.buffers.get("act", num_grouped, self.intermediate, self.setup.dtype)
            return expert_up(
                dispatched.hidden_states,
                self.w13,
                offsets,
                pairs,
                act,
                top_k=top_k,
                gated=self.gated,
                config=config,
            )
        act_q = self.buffers.get("act_q", num_grouped, self.intermediate, FP8_DTYPE)
        act_s = self.buffers.get("act_s", num_grouped, self.intermediate // BLOCK, torch.float32)
        x_q, x_s = quantized_rows(dispatched, self.buffers)
        w = self.fp8
        return expert_up_fp8(
            x_q,
            x_s,
            w.w13,
            w.w13_scale_inv,
            offsets,
            pairs,
            act_q,
            act_s,
            top_k=top_k,
            gated=self.gated,
            config=config,
        )

    def _down(
        self,
        act: torch.Tensor | tuple[torch.Tensor, torch.Tensor],  # what ``_up`` returned
        offsets: torch.Tensor,
        pairs: torch.Tensor | None,
        weights: torch.Tensor,  # [R, K'] fp32
        out: torch.Tensor,  # [R·K, H] or [R, H]
        config: TileConfig,
    ) -> torch.Tensor:
        """GEMM2 with the router weight in its epilogue, into ``out``."""
        if self.fp8 is None:
            return expert_down(act, self.w2, offsets, pairs, weights, out, config=config)
        w = self.fp8
        return expert_down_fp8(
            *act, w.w2, w.w2_scale_inv, offsets, pairs, weights, out, config=config
        )

    def forward(self, dispatched: Dispatched) -> torch.Tensor:
        hidden = dispatched.hidden_states  # [R, H]
        num_rows = hidden.size(0)
        dtype = self.setup.dtype
        out = self.buffers.get("out", num_rows, self.hidden, dtype)  # [R, H]
        if num_rows == 0:
            return out
        if dispatched.layout is TopkLayout.EXPANDED:
            assert dispatched.expert_offsets is not None
            offsets = dispatched.expert_offsets
            tiles = self._tile_configs(num_rows)
            act = self._up(dispatched, offsets, None, num_rows, 1, tiles.up)
            return self._down(act, offsets, None, dispatched.topk_weights, out, tiles.down)
        ids = dispatched.topk_ids  # [R, K]
        top_k = ids.size(1)
        num_pairs = num_rows * top_k
        pairs = self.buffers.get("pairs", num_pairs, 1, torch.int32).view(-1)  # [R·K]
        sort_pairs(
            ids, pairs, self._offsets, local_offset=self.local_offset, num_local=self.num_local
        )
        # served pairs per row: K at world size 1, about K·L/E where L of E experts are local
        served = num_rows * max(1, min(top_k, top_k * self.num_local // self.placement.num_experts))
        tiles = self._tile_configs(served)
        act = self._up(dispatched, self._offsets, pairs, num_pairs, top_k, tiles.up)  # [R·K, I]
        per_pair = self.buffers.get("per_pair", num_pairs, self.hidden, dtype)  # [R·K, H]
        self._down(act, self._offsets, pairs, dispatched.topk_weights, per_pair, tiles.down)
        return sum_slots(
            per_pair, ids, out, local_offset=self.local_offset, num_local=self.num_local
        )
