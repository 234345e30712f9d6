"""The SM90 warp-specialized fp8 GEMMs (``kernels/expert_gemm_fp8_ws.py``, Gluon) against the
torch specs of the contract (``expert_up_fp8_spec`` / ``expert_down_fp8_spec``).

Gluon has no interpreter: on an H100/H200 the kernels run against the specs (uneven experts, an
empty one, tiles whose second warpgroup has no rows, rings that wrap, both layouts, rows TMA
cannot read, EXPANDED padding, NaN codes in rows nobody serves); everywhere the kernels are
compiled for sm_90a through Triton's own compiler (``compile_for_sm90``) and their machine code
is checked for what the design needs: fp8 wgmma, three warpgroups with their own register
budgets, and TMA and ``cp.async`` loads where expected.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # in case conftest did not run first
pytest.importorskip("triton", reason="triton is not installed")

from ep_runtime.kernels import expert_gemm_fp8, expert_gemm_fp8_ws, expert_rows
from ep_runtime.kernels.expert_tiles import TileConfig
from ep_runtime.quantization import FP8_DTYPE, quantize_activations, quantize_weight_blocks
from tests.test_fp8_triton import nan_codes_past

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(
    not SM90,
    reason="needs a CUDA device of SM90 (the warp-specialized Gluon kernels)"
    if not torch.cuda.is_available()
    else f"needs SM90, this device is SM{''.join(map(str, torch.cuda.get_device_capability()))}",
)
UP = TileConfig(128, 128, 128, group_m=8, num_warps=4, num_stages=4, warp_specialized=True)
DOWN = dataclasses.replace(UP, block_n=256)
SHAPES = [(1152, 256), (512, 640)]  # (H, I): 9 and 4 GEMM1 steps, 2 and 5 GEMM2 steps
# Hopper's fp8 wgmma accumulates each 128-deep step with about 14 mantissa bits (DeepSeek-V3
# report), relative to the step's largest partial sums: over 9 steps and through silu(g)·u a
# row's amax moved by up to 9e-4 of the spec's (H100, H 1152; the Triton kernel's wgmma tiles
# too). The bound here on the scales, and on each code (in units of its row's scale) beyond its
# e4m3 neighbour; tests/test_fp8_triton.py's 2 steps take 2^-11.
SCALE_BOUND = 2.0**-9


def assert_hopper_codes(got_q, got_s, want_q, want_s, valid_rows: int) -> None:
    """``got`` within Hopper's accumulation of the spec: scales within SCALE_BOUND, each code
    within its e4m3 neighbour plus SCALE_BOUND of the row's range (448), few codes off. A wrong
    row, tile or scale moves codes and scales by far more (the negative control below)."""
    got_q, want_q = got_q[:valid_rows].float(), want_q[:valid_rows].float()
    got_s, want_s = got_s[:valid_rows], want_s[:valid_rows]
    assert torch.isfinite(got_s).all() and torch.isfinite(got_q).all()
    distance = (got_s - want_s).abs() / want_s
    assert (distance <= SCALE_BOUND).all(), distance.max()
    spacing = torch.exp2(torch.floor(torch.log2(want_q.abs().clamp_min(2**-6))) - 3)
    excess = (got_q - want_q).abs() - spacing * 1.0001
    assert (excess <= 448 * SCALE_BOUND).all(), excess.max()
    assert (got_q != want_q).float().mean() < 0.05


def ws_problem(hidden: int, intermediate: int, layout: str, seed: int = 0):
    """Local experts 0..3 of six: expert 0 serves no row, expert 1 fewer than 64 (a tile whose
    second consumer has none), expert 2 a full tile and a partial one, expert 3 the rest;
    unused and non-local slots, blocks of very different scales."""
    g = torch.Generator().manual_seed(seed)
    rows, top_k, num_local = 300, 2, 4
    w13 = torch.randn(num_local, 2 * intermediate, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_local, hidden, intermediate, generator=g) / intermediate**0.5
    w13[2, :128] *= 30
    w2[3, -128:] /= 20
    q13, s13 = quantize_weight_blocks(w13)
    q2, s2 = quantize_weight_blocks(w2)
    x = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    r = torch.arange(rows)
    first = torch.where(r < 40, 1, torch.where(r < 230, 2, 3))
    second = torch.where(r % 3 == 0, -1, torch.where(r % 3 == 1, 3, 5))  # 5: not local
    ids = torch.stack([first, second], dim=1).to(torch.int32)
    weights = 0.25 + torch.rand(rows, top_k, generator=g)
    x_q, x_s = quantize_activations(x)
    pairs, offsets = expert_rows.sort_pairs_spec(ids, local_offset=0, num_local=num_local)
    if layout == "expanded":  # the served pairs as grouped rows, then three padding rows
        served = int(offsets[-1])
        source = pairs[:served].long() // top_k
        x_q = torch.cat([x_q[source], x_q[:3]])
        x_s = torch.cat([x_s[source], torch.full((3, hidden // 128), float("nan"))])
        weights = torch.cat([weights.reshape(-1)[pairs[:served].long()], torch.ones(3)])[:, None]
        pairs = None
    return x_q, x_s, q13, s13, q2, s2, offsets, pairs, weights, top_k, rows


def cuda(*tensors):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in tensors]


def strided_rows(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` as rows 8 bytes off a multiple of 16 apart: neither TMA nor 16-byte cp.async
    reads them (``expert_up_fp8`` runs the Triton kernel instead)."""
    wide = torch.zeros(codes.size(0), codes.size(1) + 8, dtype=codes.dtype, device=codes.device)
    wide[:, : codes.size(1)] = codes
    return wide[:, : codes.size(1)]


@needs_sm90
@pytest.mark.parametrize("stages", [4, 3])
@pytest.mark.parametrize("rows", ["as-dispatched", "strided"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"H{s[0]}-I{s[1]}")
def test_ws_gemm1_matches_its_spec(shape, layout, rows, stages):
    hidden, intermediate = shape
    x_q, x_s, q13, s13, _, _, offsets, pairs, _, top_k, _ = ws_problem(hidden, intermediate, layout)
    want_q, want_s = expert_gemm_fp8.expert_up_fp8_spec(
        x_q, x_s, q13, s13, offsets, pairs, top_k=top_k, gated=True
    )
    valid = int(offsets[-1])
    if pairs is None:
        x_q = nan_codes_past(x_q, valid)
    grouped = want_q.size(0)
    args = cuda(x_q, x_s, q13, s13, offsets, pairs)
    if rows == "strided":
        args[0] = strided_rows(args[0])
        assert not expert_gemm_fp8_ws.tma_readable(args[0])
    config = dataclasses.replace(UP, num_stages=stages)
    outputs = []
    for _ in range(2):
        out_q = torch.full((grouped, intermediate), float("nan"), device="cuda").to(FP8_DTYPE)
        out_s = torch.full((grouped, intermediate // 128), float("nan"), device="cuda")
        expert_gemm_fp8.expert_up_fp8(*args, out_q, out_s, top_k=top_k, gated=True, config=config)
        outputs.append((out_q.cpu(), out_s.cpu()))
    (got_q, got_s), (again_q, again_s) = outputs
    assert_hopper_codes(got_q, got_s, want_q, want_s, valid)
    assert torch.equal(again_q[:valid].view(torch.uint8), got_q[:valid].view(torch.uint8))
    assert torch.equal(again_s[:valid], got_s[:valid])  # deterministic


@needs_sm90
@pytest.mark.parametrize("stages", [4, 3])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"H{s[0]}-I{s[1]}")
def test_ws_gemm2_matches_its_spec(shape, layout, stages):
    hidden, intermediate = shape
    x_q, x_s, q13, s13, q2, s2, offsets, pairs, weights, top_k, rows = ws_problem(
        hidden, intermediate, layout, seed=1
    )
    a_q, a_s = expert_gemm_fp8.expert_up_fp8_spec(
        x_q, x_s, q13, s13, offsets, pairs, top_k=top_k, gated=True
    )
    valid = int(offsets[-1])
    a_q = nan_codes_past(a_q, valid)
    num_out = rows * top_k if pairs is not None else a_q.size(0)
    want = expert_gemm_fp8.expert_down_fp8_spec(
        a_q, a_s, q2, s2, offsets, pairs, weights, num_out=num_out, dtype=torch.bfloat16
    )
    written = torch.zeros(num_out, dtype=torch.bool)
    if pairs is not None:
        written[pairs[:valid].long()] = True
    else:
        written[:] = True  # EXPANDED: every row, the padding zero
    config = dataclasses.replace(DOWN, num_stages=stages)
    args = cuda(a_q, a_s, q2, s2, offsets, pairs, weights)
    outs = []
    for _ in range(2):
        out = torch.full((num_out, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
        expert_gemm_fp8.expert_down_fp8(*args, out, config=config)
        outs.append(out.cpu())
    got, again = outs
    if pairs is None:
        assert not got[valid:].float().any()
    ref = want[written].float()
    bound = 2 * 2.0**-7 * (ref.abs() + 0.01 * ref.abs().amax(dim=1, keepdim=True))
    assert torch.isfinite(got[written]).all()
    assert ((got[written].float() - ref).abs() <= bound).all()
    assert torch.equal(again[written], got[written])  # deterministic


@needs_sm90
def test_ws_spec_check_catches_a_wrong_scale():
    """Negative control: the same checks fail when one expert's weight scales are doubled."""
    hidden, intermediate = SHAPES[0]
    x_q, x_s, q13, s13, _, _, offsets, pairs, _, top_k, _ = ws_problem(
        hidden, intermediate, "standard"
    )
    want_q, want_s = expert_gemm_fp8.expert_up_fp8_spec(
        x_q, x_s, q13, s13, offsets, pairs, top_k=top_k, gated=True
    )
    wrong = s13.clone()
    wrong[2, 0, 3] *= 2  # one block of expert 2's gate rows
    out_q = torch.empty(want_q.shape, dtype=FP8_DTYPE, device="cuda")
    out_s = torch.empty(want_s.shape, device="cuda")
    args = cuda(x_q, x_s, q13, wrong, offsets, pairs)
    expert_gemm_fp8.expert_up_fp8(*args, out_q, out_s, top_k=top_k, gated=True, config=UP)
    with pytest.raises(AssertionError):
        assert_hopper_codes(out_q.cpu(), out_s.cpu(), want_q, want_s, int(offsets[-1]))


# --------------------------------------------------------------------------- machine code


class Sm90CompileOnlyDriver:
    """A stand-in for Triton's active driver that only names the sm_90a target, so Triton's own
    compiler builds the kernels without a GPU (nothing is launched or loaded)."""

    def is_active(self) -> bool:
        return True

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0


def compile_for_sm90(kernel, *args, **kwargs):
    """``kernel.warmup`` (compile only) for sm_90a, on any machine."""
    from triton.runtime.driver import driver

    driver.set_active(Sm90CompileOnlyDriver())
    try:
        return kernel.warmup(*args, grid=(1,), **kwargs)
    finally:
        if torch.cuda.is_available():
            driver.reset_active()
        else:
            driver.set_active(None)


def descriptor(codes: torch.Tensor, rows: int):
    """A TMA descriptor of host ``codes`` for compilation only (the base address is not read)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for([rows, 128], gl.float8e4nv)
    return TensorDescriptor(codes, list(codes.shape), list(codes.stride()), [rows, 128], layout)


def disassembly(compiled) -> str:
    """The SASS of a compiled kernel (Triton's own cuobjdump)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"ws_{os.getpid()}_{compiled.name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    try:
        return subprocess.run(
            [str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    finally:
        cubin.unlink()


@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_ws_kernels_compile_for_sm90_as_designed(layout):
    """Each kernel builds for sm_90a with fp8 wgmma (QGMMA 64×128×32), a loader warpgroup of 40
    registers beside consumers of 232, TMA loads of the weights, and ``cp.async`` for the rows
    only where they are gathered (STANDARD's GEMM1)."""
    L, H, I, R, K = 4, 512, 256, 64, 2  # noqa: E741 (the contract's names)
    sorted_ = layout == "standard"
    fp8, f32 = FP8_DTYPE, torch.float32
    x_q, x_s = torch.empty(R, H, dtype=fp8), torch.empty(R, H // 128, dtype=f32)
    w13, s13 = torch.empty(L * 2 * I, H, dtype=fp8), torch.empty(L, 2 * I // 128, H // 128)
    w2, s2 = torch.empty(L * H, I, dtype=fp8), torch.empty(L, H // 128, I // 128)
    offsets, pairs = torch.zeros(L + 1, dtype=torch.int32), torch.zeros(R * K, dtype=torch.int32)
    act_q, act_s = torch.empty(R * K, I, dtype=fp8), torch.empty(R * K, I // 128)
    weights, out = torch.empty(R, K), torch.empty(R * K, H, dtype=torch.bfloat16)
    ws = expert_gemm_fp8_ws
    up = compile_for_sm90(
        ws._up_ws_kernel, None if sorted_ else descriptor(x_q, 128), x_q, H, x_s, H // 128,
        pairs, offsets, descriptor(w13, 128), s13, s13.stride(0), s13.stride(1), act_q, I,
        act_s, I // 128, L, K, I, H, 10, SORTED=sorted_,
        **ws._launch_options(L, UP, 128),
    )  # fmt: skip
    down = compile_for_sm90(
        ws._down_ws_kernel, descriptor(act_q, 128), act_s, I // 128, pairs, offsets,
        descriptor(w2, 128), s2, s2.stride(0), s2.stride(1), weights, K, 1, out, H, L, K, H, I,
        10, R * K, SORTED=sorted_, ZERO_PAD=not sorted_, **ws._launch_options(L, DOWN, 256),
    )  # fmt: skip
    for compiled, gathers in ((up, sorted_), (down, False)):
        sass = disassembly(compiled)
        assert "QGMMA.64x128x32.F32.E4M3.E4M3" in sass
        budgets = set(re.findall(r"USETMAXREG\.\w+\.CTAPOOL\s+(?:UP\d, )?(0x[0-9a-f]+)", sass))
        assert {hex(ws.LOADER_REGS.value), hex(ws.CONSUMER_REGS.value)} <= budgets, budgets
        assert "UTMALDG" in sass  # the weights (and contiguous rows) through TMA
        assert ("LDGSTS" in sass) is gathers  # cp.async for gathered rows only
