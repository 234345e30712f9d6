"""The shapes the row transport's ops agree on: the packed row and the per-peer chunk (the
forward header and the control block are ``wire.py``'s).

A packed row is ``hidden | ids int32 [K_max] | weights fp32 [K_max]``, or with fp8 dispatch
``e4m3 hidden [H] | fp32 scales [H/128] | ids | weights`` (the contract's ``q(x)``, quantized in
pack: half the bytes of bf16 rows, plus 4 bytes per 128 columns); a token travels once to
each rank owning at least one of its experts. Every all-to-all buffer (dispatch and combine, both
directions) is a list of per-peer chunks ``[header rows][token rows]``, so the row a token occupies
in the dispatch send buffer is the row its result occupies in the combine receive buffer, and a
received row's index is the index of its pre-reduced result in the combine send buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ep_runtime.kernels.wire import HEADER_BYTES
from ep_runtime.quantization import BLOCK, FP8_DTYPE


def _align(num_bytes: int, alignment: int) -> int:
    return -(-num_bytes // alignment) * alignment


@dataclass(frozen=True)
class RowFormat:
    """Byte layout of one packed row. The hidden part is at least a header long, so a header row
    holds its fields where a token row holds its hidden state, and ``-1`` ids in both. (The
    sizes and offsets are computed once per format: every forward reads them.)"""

    hidden_size: int
    dtype: torch.dtype  # the compute dtype (of the rows handed to pack)
    max_top_k: int
    quantized: bool = False  # fp8 dispatch: e4m3 hidden and its per-128-column fp32 scales

    def __post_init__(self) -> None:
        if self.quantized:  # the header overlays the e4m3 part only (H ≥ 128 > 64 bytes)
            assert self.hidden_size % BLOCK == 0 and self.hidden_size >= HEADER_BYTES

    @cached_property
    def hidden_dtype(self) -> torch.dtype:
        """The dtype of the hidden part on the wire."""
        return FP8_DTYPE if self.quantized else self.dtype

    @cached_property
    def payload_bytes(self) -> int:
        """Bytes of one token's hidden state on the wire (e4m3 and scales when quantized)."""
        if self.quantized:
            return self.hidden_size + 4 * (self.hidden_size // BLOCK)
        return self.hidden_size * self.dtype.itemsize

    @cached_property
    def hidden_bytes(self) -> int:
        return _align(max(self.payload_bytes, HEADER_BYTES), 16)

    @cached_property
    def ids_offset(self) -> int:
        return self.hidden_bytes

    @cached_property
    def weights_offset(self) -> int:
        return self.hidden_bytes + 4 * self.max_top_k

    @cached_property
    def row_bytes(self) -> int:
        return _align(self.weights_offset + 4 * self.max_top_k, 16)

    def hidden(self, rows: torch.Tensor) -> torch.Tensor:
        """``[R, H]`` view (row stride ``row_bytes``) of the hidden states in ``rows``."""
        end = self.hidden_size * self.hidden_dtype.itemsize
        return rows[:, :end].view(self.hidden_dtype)

    def scales(self, rows: torch.Tensor) -> torch.Tensor:
        """``[R, H/128]`` fp32 view of the scales of the e4m3 hidden states (quantized)."""
        assert self.quantized
        return rows[:, self.hidden_size : self.payload_bytes].view(torch.float32)

    def payload_words(self, rows: torch.Tensor) -> torch.Tensor:
        """``[R, payload / 4]`` fp32 view of e4m3 hidden and scales together (quantized): what
        regrouping moves, bit for bit (nothing computes on these words)."""
        assert self.quantized
        return rows[:, : self.payload_bytes].view(torch.float32)

    def split_payload(self, words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``payload_words``-shaped ``[N, payload / 4]`` fp32 → (e4m3 ``[N, H]``, fp32
        ``[N, H/128]``) views."""
        raw = words.view(torch.uint8)
        return raw[:, : self.hidden_size].view(FP8_DTYPE), raw[:, self.hidden_size :].view(
            torch.float32
        )

    def ids(self, rows: torch.Tensor, top_k: int) -> torch.Tensor:
        """``[R, top_k]`` int32 view of the ids."""
        return rows[:, self.ids_offset : self.ids_offset + 4 * top_k].view(torch.int32)

    def weights(self, rows: torch.Tensor, top_k: int) -> torch.Tensor:
        """``[R, top_k]`` fp32 view of the weights."""
        return rows[:, self.weights_offset : self.weights_offset + 4 * top_k].view(torch.float32)

    def header(self, rows: torch.Tensor) -> torch.Tensor:
        """``[R, HEADER_INTS]`` int32 view of the header fields (meaningful in header rows)."""
        return rows[:, :HEADER_BYTES].view(torch.int32)


@dataclass(frozen=True)
class ChunkLayout:
    """Per-peer chunks of an all-to-all buffer: ``header_rows`` then the token rows.

    Exact mode: chunk p holds exactly ``header_rows + rows[p]`` rows. Capacity mode: every chunk
    holds ``header_rows + capacity`` rows (static shapes)."""

    header_rows: int
    capacity: int | None  # None: exact sizes

    def chunk_rows(self, rows: list[int]) -> list[int]:
        """Rows of each peer's chunk, for per-peer token counts ``rows`` (exact mode)."""
        if self.capacity is not None:
            return [self.header_rows + self.capacity] * len(rows)
        return [self.header_rows + count for count in rows]

    def total_rows(self, rows: list[int]) -> int:
        return sum(self.chunk_rows(rows))


def header_rows_for(hidden_size: int, dtype: torch.dtype) -> int:
    """Header rows per chunk: enough ``[H]`` rows of ``dtype`` to hold a header."""
    return -(-HEADER_BYTES // (hidden_size * dtype.itemsize))


def chunk_starts(rows: torch.Tensor, chunks: ChunkLayout) -> torch.Tensor:
    """``[W]`` int64 first row (header) of each peer's chunk, for per-peer token counts ``rows``."""
    world = rows.numel()
    if chunks.capacity is not None:
        stride = chunks.header_rows + chunks.capacity
        return torch.arange(world, dtype=torch.int64, device=rows.device) * stride
    sizes = rows.to(torch.int64) + chunks.header_rows
    return sizes.cumsum(0) - sizes
