"""FP8 dispatch on the row transport: the packed row ``e4m3 hidden | fp32 scales[H/128] | ids |
weights`` (``kernels/layout.py``), written by pack (torch spec and Triton kernel bitwise equal,
its round trip against the contract's quantizer), and the layer: rows dispatched as ``q(x)`` give
results bitwise equal to bf16 rows quantized on the expert side (the in-memory test transport
keeps rows unquantized), for the fp8 twin and the Triton experts, both layouts and modes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from ep_runtime import EPMoE, MoEConfig
from ep_runtime.bench.metrics import Traffic, dispatch_row_bytes
from ep_runtime.kernels import TORCH_OPS as torch_ops
from ep_runtime.kernels import TRITON_OPS as triton_ops
from ep_runtime.kernels.layout import ChunkLayout, RowFormat, chunk_starts, header_rows_for
from ep_runtime.kernels.wire import HEADER_INTS, Field, HeaderFields
from ep_runtime.quantization import FP8_DTYPE, dequantize_weight_blocks, quantize_activations
from tests.support import memory_transport
from tests.support.kernel_checks import (
    BF16,
    FP32,
    assert_bitwise,
    generator,
    new_control,
    routing_ids,
)
from tests.test_fp8 import fp8_inputs

PACK_CASES = [
    # T, K, max_k, E, W, H, dtype, capacity (None: exact), poison, strided x
    (0, 2, 3, 4, 2, 128, FP32, None, False, False),
    (9, 2, 4, 6, 3, 256, FP32, 12, True, True),
    (12, 3, 3, 8, 2, 384, BF16, None, False, True),
    (5, 2, 2, 4, 1, 2304, BF16, 8, True, False),  # H over one program's block
]


def packed(device, T, K, max_k, E, W, H, dtype, capacity, poison, strided):
    g = generator(T * 7 + H)
    x = torch.randn(T, H + 5 if strided else H, generator=g).to(dtype)
    x = (x[:, 2 : H + 2] if strided else x).to(device)
    x[: min(T, 2)] *= 1e3  # rows of another scale
    weights = torch.rand(T, K, generator=g).to(device)
    ids = routing_ids(T, K, E, invalid=False, seed=T).to(device)
    header = torch.empty(W, HEADER_INTS, dtype=torch.int32, device=device)
    route = torch_ops.route_tokens(
        ids,
        num_experts=E,
        experts_per_rank=E // W,
        world_size=W,
        drop_invalid=False,
        control=new_control(device, [0]),
        fields=HeaderFields(0, 77, 1, 1, K, 1),
        header_out=header,
    )
    row_format = RowFormat(H, dtype, max_k, quantized=True)
    chunks = ChunkLayout(header_rows_for(H, dtype), capacity)
    total = chunks.total_rows(route.header[:, Field.NUM_ROWS].tolist())
    initial = torch.randint(0, 256, (total, row_format.row_bytes), generator=g, dtype=torch.uint8)
    sends = {}
    for name, ops in (("triton", triton_ops), ("torch", torch_ops)):
        sends[name] = initial.clone().to(device)
        ops.pack_rows(x, weights, route, sends[name], row_format, chunks, poison=poison)
    return x, weights, route, row_format, chunks, sends


@pytest.mark.parametrize(
    ("T", "K", "max_k", "E", "W", "H", "dtype", "capacity", "poison", "strided"), PACK_CASES
)
def test_fp8_pack_kernel_is_its_spec_bitwise(
    device, T, K, max_k, E, W, H, dtype, capacity, poison, strided
):
    *_, sends = packed(device, T, K, max_k, E, W, H, dtype, capacity, poison, strided)
    assert_bitwise(sends["triton"], sends["torch"], "every byte of the send buffer")


@pytest.mark.parametrize("poison", [False, True])
def test_packed_fp8_row_round_trip(device, poison):
    """Each token row reads back as the contract's q(x) of its token (values and scales),
    its ids and weights; filler rows hold code 0 / scale 0 (NaN when poisoned)."""
    x, weights, route, row_format, chunks, sends = packed(
        device, 9, 2, 3, 6, 3, 256, BF16, 12, poison, True
    )
    send = sends["triton"].cpu()
    q, s = quantize_activations(x.cpu())
    rows = route.header[:, Field.NUM_ROWS].cpu()
    starts = chunk_starts(rows, chunks)
    token_rows = []
    for chunk, (start, count) in enumerate(zip(starts.tolist(), rows.tolist(), strict=True)):
        for slot in range(count):
            token = int(route.token_of[chunk, slot])
            row = start + chunks.header_rows + slot
            token_rows.append(row)
            got = send[row : row + 1]
            code = row_format.hidden(got).view(torch.uint8)[0]
            assert torch.equal(code, q[token].view(torch.uint8))
            assert torch.equal(row_format.scales(got)[0], s[token])
            assert torch.equal(row_format.ids(got, 2)[0], route.ids[token].cpu())
            assert torch.equal(row_format.weights(got, 2)[0], weights[token].cpu())
    filler = torch.ones(send.size(0), dtype=torch.bool)
    filler[token_rows] = False
    filler[starts] = False  # header rows
    hidden, scales = row_format.hidden(send)[filler], row_format.scales(send)[filler]
    assert row_format.hidden(send).dtype == FP8_DTYPE and filler.any()
    if poison:
        assert hidden.float().isnan().all() and scales.isnan().all()
    else:
        assert not hidden.float().any() and not scales.any()


def test_row_bytes_show_the_saving():
    """The DeepSeek-V3 row: 7168 e4m3 + 56 scales + 8 ids + 8 weights against 7168 bf16."""
    fp8 = RowFormat(7168, BF16, 8, quantized=True)
    bf16 = RowFormat(7168, BF16, 8)
    assert fp8.row_bytes == 7168 + 4 * 56 + 64 and bf16.row_bytes == 2 * 7168 + 64
    assert dispatch_row_bytes(7168, BF16, 8, quantized=True) == fp8.row_bytes
    traffic = Traffic(rows=[[3, 2], [1, 4]], row_bytes=fp8.row_bytes, combine_row_bytes=2 * 7168)
    assert traffic.dispatch_received_bytes(0) == 4 * fp8.row_bytes
    assert traffic.combine_bytes(0) == 4 * 2 * 7168  # combine stays bf16


# --------------------------------------------------------------------------- the layer
@pytest.mark.parametrize("experts", ["reference", "triton"])
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_fp8_dispatch_equals_quantizing_on_the_expert_side(device, experts, layout, mode):
    """torch_a2a sends q(x) (fp8 dispatch), the in-memory transport the bf16 rows (the experts
    quantize them): the same values reach GEMM1, so the outputs are bitwise equal."""
    E, K, H, I = 8, 3, 256, 128  # noqa: E741
    x, ids, topk_weights, (q13, s13, q2, s2) = fp8_inputs("silu", BF16, tokens=16)
    config = MoEConfig(E, K, H, I, dtype=BF16, quantization="fp8_block")
    transport = memory_transport.register()
    outputs = {}
    for dispatcher in ("torch_a2a", transport):
        layer = EPMoE(
            config,
            max_tokens_per_rank=16,
            dispatcher=dispatcher,
            experts=experts,
            layout=layout,
            mode=mode,
            device=device,
        )
        try:
            layer.load_weights(q13, q2, w13_scale_inv=s13, w2_scale_inv=s2)
            outputs[dispatcher] = layer(x.to(device), ids.to(device), topk_weights.to(device))
        finally:
            layer.close()
    assert torch.equal(outputs["torch_a2a"], outputs[transport])
    assert outputs["torch_a2a"].abs().sum() > 0


def test_fp8_and_bf16_layers_of_one_shape_get_their_own_dispatchers():
    """Dispatchers are shared per setup: an fp8 layer beside a bf16 layer of the same shape in
    one process must not get the other's row format (each matches its own layer's math)."""
    E, K, H, I = 8, 3, 256, 128  # noqa: E741
    x, ids, topk_weights, (q13, s13, q2, s2) = fp8_inputs("silu", BF16, tokens=16)
    options = dict(experts="reference", device="cpu")  # the inputs' device
    fp8 = EPMoE(MoEConfig(E, K, H, I, dtype=BF16, quantization="fp8_block"), **options)
    bf16 = EPMoE(MoEConfig(E, K, H, I, dtype=BF16), **options)
    try:
        assert fp8.dispatcher is not bf16.dispatcher
        assert fp8.dispatcher.row_format.quantized and not bf16.dispatcher.row_format.quantized
        fp8.load_weights(q13, q2, w13_scale_inv=s13, w2_scale_inv=s2)
        bf16.load_weights(
            dequantize_weight_blocks(q13, s13).to(BF16), dequantize_weight_blocks(q2, s2).to(BF16)
        )
        assert dispatched_dtype(fp8, x, ids, topk_weights) == FP8_DTYPE
        assert dispatched_dtype(bf16, x, ids, topk_weights) == BF16
    finally:
        fp8.close()
        bf16.close()


def dispatched_dtype(layer: EPMoE, x, ids, weights) -> torch.dtype:
    dispatched, _ = layer.dispatcher.dispatch(x, ids, weights, layer.layout, layer=layer.identity)
    return dispatched.hidden_states.dtype
