"""Hugging Face ``transformers`` MoE models with their sparse-MoE blocks expert-parallel.

On every rank (data-parallel attention, expert-parallel MoE; the default process group)::

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    report = patch_moe_blocks(model)                       # EPMoE options as keywords
    result = greedy_generate(model, report, prompt_ids, max_new_tokens=32)

``patch_moe_blocks`` replaces every supported sparse-MoE block with an ``EPMoEBlock``: the block's
own router module runs on the rank (the same logits and top-k, the same output-recording hooks),
an ``EPMoE`` that holds only this rank's expert shard computes the routed experts from the
router's top-k ids and weights, and the block's shared experts (if any) run locally. Nothing
else in the model changes. ``greedy_generate`` keeps every rank in every MoE collective until all
ranks are done: a rank with no request, or one that has finished, runs each MoE block on zero
tokens, in layer order.

Elastic (ep_runtime/elastic/): ``patch_moe_blocks(model, elastic=group, expert_source=...)``
builds every block's ``EPMoE`` on an ``ElasticGroup``; when a rank dies, ``greedy_generate`` on
the survivors rolls back what the failed step added to the KV cache, recovers the group and runs
the step again, so their requests end with the tokens they would have had.

Needs the ``hf`` extra (``transformers``); written and tested against transformers 5.24.

One job a module: ``architectures`` (the supported blocks, their router readers), ``block``
(``EPMoEBlock``), ``patching`` (``patch_moe_blocks``, the expert-weight fusion), ``report``
(``PatchReport``, the handle of lockstep loops), ``graphs`` (the blocks' decode forwards as CUDA
graphs, ``cuda_graph_tokens``), ``generation`` (``greedy_generate``, ``MoEClock``), ``models``
(random tiny models, among them FP8 experts, their ``RandomExpertSource``, ``load_model``,
``eos_ids``; the only one that imports ``transformers``) and ``fp8`` (whether an unpatched
model's FP8 experts run here, the contract's math as their forward where they do not).
"""

from ep_runtime.integrations.transformers.architectures import (
    ARCHITECTURES,
    SUPPORTED_BLOCKS,
    Architecture,
    RouterSettings,
    UnsupportedMoEBlockError,
    architecture_of,
)
from ep_runtime.integrations.transformers.block import EPMoEBlock
from ep_runtime.integrations.transformers.generation import GreedyResult, MoEClock, greedy_generate
from ep_runtime.integrations.transformers.models import (
    FP8_RANDOM_MODELS,
    NAMED_MODELS,
    RANDOM_MODELS,
    TESTED_TRANSFORMERS,
    RandomExpertSource,
    build_random_model,
    eos_ids,
    load_model,
    random_config,
    require_transformers,
)
from ep_runtime.integrations.transformers.patching import (
    ExpertSource,
    find_moe_blocks,
    patch_moe_blocks,
)
from ep_runtime.integrations.transformers.report import PatchedBlock, PatchReport, tensor_bytes

__all__ = [
    "ARCHITECTURES",
    "FP8_RANDOM_MODELS",
    "NAMED_MODELS",
    "RANDOM_MODELS",
    "SUPPORTED_BLOCKS",
    "TESTED_TRANSFORMERS",
    "Architecture",
    "EPMoEBlock",
    "ExpertSource",
    "GreedyResult",
    "MoEClock",
    "PatchReport",
    "PatchedBlock",
    "RandomExpertSource",
    "RouterSettings",
    "UnsupportedMoEBlockError",
    "architecture_of",
    "build_random_model",
    "eos_ids",
    "find_moe_blocks",
    "greedy_generate",
    "load_model",
    "patch_moe_blocks",
    "random_config",
    "require_transformers",
    "tensor_bytes",
]
