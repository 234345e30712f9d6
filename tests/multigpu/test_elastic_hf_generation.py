"""An elastic, expert-parallel transformers model keeps generating after a rank dies (CPU ranks,
gloo, W = 3, a tiny random qwen3-moe; tests/multigpu/elastic_hf_rank.py): original rank 1 is
SIGKILLed inside lockstep step 4 (after the first layer's attention appended to the KV cache).
The survivors' tokens and logits must be the unpatched model's (transformers' own greedy
``generate`` in this process), each having undone and run again the failed step once, and the
recovery must have read exactly the lost rank's experts from the seeded model's source. One
group run, several checks."""

from __future__ import annotations

import torch

from ep_runtime.integrations.transformers import build_random_model, random_config
from ep_runtime.tolerance import compare_per_token, tolerance_for
from tests.multigpu import elastic_hf_rank
from tests.multigpu.rank_scripts import run_rank_scripts
from tests.support.hf_oracle import hf_greedy, model_eos, moe_shape, needs_transformers

pytestmark = needs_transformers
WORLD, VICTIM, KILL_STEP = 3, 1, 4
SEED = 2  # every request's greedy tokens vary (no token repeated throughout)


def test_survivors_finish_their_requests_with_the_unpatched_models_tokens() -> None:
    reactions, codes, errors = run_rank_scripts(
        "tests.multigpu.elastic_hf_rank",
        WORLD,
        {"seed": SEED, "kill": f"{VICTIM}@{KILL_STEP}"},
        timeout_s=120,
    )
    for rank, code in enumerate(codes):  # the victim is killed, no survivor dies
        assert code == (-9 if rank == VICTIM else 0), (rank, code, errors[rank][-3000:])
    survivors = sorted(reactions, key=lambda r: r["rank"])
    assert [r["rank"] for r in survivors] == [0, 2], (survivors, errors)

    config = random_config(elastic_hf_rank.ARCH)
    reference = build_random_model(config, seed=SEED)  # never patched
    eos = model_eos(reference)
    _, hidden, intermediate = moe_shape(reference)
    tolerance = tolerance_for(torch.float32, max(hidden, intermediate))
    for survivor in survivors:
        rank = survivor["rank"]
        tokens, logits = hf_greedy(
            reference,
            elastic_hf_rank.prompt(rank, config.vocab_size),
            elastic_hf_rank.NEW_TOKENS[rank],
            eos,
        )
        assert survivor["tokens"] == tokens, (rank, survivor["tokens"], tokens)
        comparison = compare_per_token(torch.tensor(survivor["logits"]), logits, tolerance)
        assert comparison.passed, f"rank {rank}: {comparison.describe()}"
        # both failed inside step 4 and ran it again once, on the group of the two of them
        assert survivor["retried_steps"] == 1, survivor["recovery_lines"]
        assert survivor["lost_ranks"] == [VICTIM]
        assert survivor["members"] == [[0, 2]]
        assert (survivor["new_rank"], survivor["world"]) == ([0, 2].index(rank), 2)
        assert survivor["steps"] == max(elastic_hf_rank.NEW_TOKENS[r] for r in (0, 2))
        assert survivor["idle_steps"] == survivor["steps"] - len(tokens)
        # the victim's 4 experts of each of the 2 MoE blocks (12 over 3 ranks) came from the
        # source; every slot holds, bitwise, the seeded expert its new placement names
        assert survivor["from_source"] == [[[4, 5, 6, 7], [4, 5, 6, 7]]]
        assert survivor["slots_hold_their_experts"]
        assert "expert_source: expected a callable" in survivor["refused"]["no_source"]
        assert "group: expected None where elastic= is given" in survivor["refused"]["group_too"]
    assert len({tuple(r["fingerprints"]) for r in survivors}) == 1, survivors
