"""``load_weights(weights_are=...)`` on real ranks where the rule matters: W = 2, E = 4, R = 4,
so a rank's S = 4 slots are as many as the logical experts. ``"auto"`` reads ``[4, …]`` as the
global experts; after a rebalance, ``"slots"`` takes the same shape as this rank's slots in
slot order. Both give ``reference_moe``'s output; slot weights read as global do not (the
negative control showing the two readings differ)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ep_runtime import EPMoE, reference_moe
from ep_runtime.eplb import zipf_routing
from ep_runtime.tolerance import compare_per_token, tolerance_for
from tests.multigpu.rank_inputs import CaseSpec, device, make_weights

SPEC = CaseSpec(num_experts=4, hidden=64, cap=32, dtype=torch.float32)


def reload_cases() -> dict:
    rank, dev = dist.get_rank(), device()
    w13, w2 = make_weights(SPEC)  # [4, ...], the same on every rank
    ids, weights = zipf_routing(24, 4, SPEC.top_k, 1.2, seed=1, rank=rank)
    x = torch.randn(24, SPEC.hidden, generator=torch.Generator().manual_seed(rank))
    ref, scale = reference_moe(x, ids, weights, w13, w2, SPEC.activation, return_scale=True)
    tolerance = tolerance_for(SPEC.dtype, max(SPEC.hidden, SPEC.intermediate))
    layer = EPMoE(SPEC.config(), dispatcher=SPEC.dispatcher, device=dev, num_redundant_experts=4)

    def passes() -> bool:
        out = layer(x.to(dev), ids.to(dev), weights.to(dev)).cpu()
        return compare_per_token(out, ref, tolerance, scale).passed

    try:
        layer.load_weights(w13, w2)  # auto: [E] global
        passed = {"auto_global": passes()}
        for load in ([40.0, 30.0, 2.0, 1.0], [40.0, 30.0, 1.0, 2.0]):
            layer.rebalance(torch.tensor(load))  # rank 0's slots end as experts [0, 1, 0, 2]
        slots = list(layer.placement.experts_on_rank(rank))
        layer.load_weights(w13[slots], w2[slots], weights_are="slots")
        passed["slots"] = passes()
        layer.load_weights(w13[slots], w2[slots])  # auto reads them as global: wrong experts
        passed["slots_read_as_global"] = passes()
        layer.load_weights(w13, w2, weights_are="global")
        passed["explicit_global"] = passes()
        dist.barrier()
        return {"passed": passed, "slots": slots}
    finally:
        layer.close()


def test_weights_are_resolves_s_equal_to_e(pool_factory) -> None:
    results = pool_factory(2).run_ok(reload_cases)
    # slots s with s[s[i]] != s[i] somewhere, so that reading them as global picks other experts
    assert results[0]["slots"] == [0, 1, 0, 2], results[0]["slots"]
    for rank, result in enumerate(results):
        passed = result["passed"]
        assert passed["auto_global"] and passed["slots"] and passed["explicit_global"], rank
    assert not all(r["passed"]["slots_read_as_global"] for r in results)
