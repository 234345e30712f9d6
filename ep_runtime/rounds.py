"""How many tokens one exact-mode round carries: as many as the forward has, unless a bound says
otherwise.

Exact mode sizes its buffers to the forward it is given, so a forward runs as one round by
default. Three bounds can split it into rounds of at most ``b`` tokens (the smallest wins):

- the user's ``max_tokens_per_rank`` (a memory bound they chose; agreed by every rank at build);
- the dispatcher's own (``Dispatcher.max_round_tokens``: fixed-size buffers, DeepEP's
  ``ElasticBuffer``);
- on CUDA, the layer's estimate of what fits in free device memory (per rank, read when a
  forward is large enough to matter; ``bytes_per_token`` has the formula). The driver's reading
  took 50–180 µs of host on the H200 (an exact prefill forward issues in ~0.7 ms), so a layer
  reuses its last reading for ``READING_TTL_S`` while the forward fits it; a forward that does
  not fit the last reading reads again before it is split. The trade: a forward that fits a
  reading under a second old runs as one round even if memory was taken since, so in that
  window it can fail to allocate where a fresh reading would have split it.

The ranks agree on the number of rounds in every forward's header (the most any rank needs; a
rank that needs fewer sends empty rounds), so the bounds may differ between ranks and none of
them that is derived per rank enters the agreed settings.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ep_runtime.config import MoEConfig

MEMORY_FRACTION = 0.5  # of the free memory a round's buffers may take (headroom: imbalance, model)
QUERY_ABOVE_BYTES = 64 << 20  # forwards whose buffers are estimated below this never ask
READING_TTL_S = 1.0  # a layer's free-memory reading serves its forwards that fit it this long
clock = time.monotonic  # when a reading was taken (a module attribute: tests set their own)


def bytes_per_token(config: MoEConfig, world_size: int) -> int:
    """Device bytes one token of this rank adds to an exact-mode forward's buffers, taking a
    rank to receive about as many rows as it sends. With ``m = min(K, W)`` (wire rows per token:
    one per destination rank), ``s`` the compute dtype's size and a wire row ``H·s + 8K`` bytes
    (hidden, ids int32, weights fp32)::

        2·m·(H·s + 8K)          dispatch send + receive
      + 2·m·H·s                 combine send + receive
      + K·H·s                   the rows grouped by expert (EXPANDED)
      + K·(w13_rows + I)·s      GEMM1's output and the activation
      + K·H·s                   GEMM2's output
    """
    assert config.dtype is not None  # resolved (LayerSpec)
    hidden, top_k = config.hidden_size, config.top_k
    s, m = config.dtype.itemsize, min(top_k, world_size)
    wire = 2 * m * (hidden * s + 8 * top_k) + 2 * m * hidden * s
    experts = top_k * (2 * hidden + config.w13_rows + config.intermediate_size) * s
    return wire + experts


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes a forward can still allocate on ``device``: the driver's free memory plus what
    torch's caching allocator holds unused; None off CUDA (no bound)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    # one read of the allocator's counters: memory_reserved() and memory_allocated() each
    # flatten every statistic into a dict (40 % of an exact prefill forward's host time under
    # cProfile on the H200)
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    if not stats:  # the allocator not initialised: it holds nothing
        return free
    return (
        free
        + stats["reserved_bytes"]["all"]["current"]
        - stats["allocated_bytes"]["all"]["current"]
    )


@dataclass
class _Reading:
    """A layer's last free-memory reading: bytes, and ``clock()`` when read."""

    free_bytes: int = 0
    read_at: float = -math.inf


@dataclass(frozen=True)
class RoundBounds:
    """The bounds on one layer's exact-mode rounds: the fixed ones (the user's and the
    dispatcher's, the smaller of them) and what the memory one is computed from, with the
    layer's last free-memory reading (module docstring)."""

    fixed: int | None  # min(max_tokens_per_rank, Dispatcher.max_round_tokens); None: neither
    bytes_per_token: int
    device: torch.device
    _reading: _Reading = field(default_factory=_Reading, init=False, compare=False, repr=False)

    @classmethod
    def of(
        cls, user: int | None, dispatcher: int | None, bytes_per_token: int, device: torch.device
    ) -> RoundBounds:
        bounds = [b for b in (user, dispatcher) if b is not None]
        return cls(min(bounds) if bounds else None, bytes_per_token, device)

    def tokens_per_round(self, num_tokens: int) -> int:
        """Tokens per round for a forward of ``num_tokens`` on this rank (at least 1)."""
        tokens = num_tokens if self.fixed is None else min(self.fixed, num_tokens)
        needed = tokens * self.bytes_per_token
        if needed > QUERY_ABOVE_BYTES:
            free = self._free_bytes(needed)
            if free is not None:
                tokens = min(tokens, int(MEMORY_FRACTION * free) // self.bytes_per_token)
        return max(1, tokens)

    def _free_bytes(self, needed: int) -> int | None:
        """Free device bytes: the last reading where it is recent and the forward fits it (so
        it runs as one round either way), else a new one."""
        reading, now = self._reading, clock()
        if now - reading.read_at < READING_TTL_S and MEMORY_FRACTION * reading.free_bytes >= needed:
            return reading.free_bytes
        free = free_device_bytes(self.device)
        if free is not None:
            reading.free_bytes, reading.read_at = free, now
        return free
