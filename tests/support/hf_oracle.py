"""The oracle of the transformers-integration tests: the unpatched model, run by transformers.

Nothing here imports ``ep_runtime.integrations``: tokens and logits come from transformers' own
greedy ``generate`` on a model that was never patched.
"""

from __future__ import annotations

import pytest
import torch

try:
    import transformers  # noqa: F401  (lazy: the package's own import is cheap)

    HAS_TRANSFORMERS = True
except ImportError:
    HAS_TRANSFORMERS = False

# the tests that use this module skip without transformers (per test, so that tests/conftest.py
# sees the skip: expected on a developer's machine, a failure in CI, which installs the extra)
needs_transformers = pytest.mark.skipif(
    not HAS_TRANSFORMERS,
    reason="transformers is not installed (the 'hf' extra): pip install -e '.[hf]'",
)


def hf_greedy(
    model: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos: list[int]
) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy ``generate``: the new tokens and the ``[N, V]`` fp32 logits."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        ids = torch.tensor([prompt])  # [1, P]; an explicit mask: no id is taken for padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out.sequences[0, len(prompt) :].tolist(), torch.stack(
        [step[0].float() for step in out.logits]
    )


def routed_expert_numel(model: torch.nn.Module) -> int:
    """Elements of the routed experts' tensors (``….experts.gate_up_proj`` / ``down_proj``)."""
    return sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)


def moe_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """``(E, H, I)`` of the model's first MoE block, from its own expert tensors."""
    experts = next(m for name, m in model.named_modules() if name.endswith(".experts"))
    num_experts, _, hidden = experts.gate_up_proj.shape
    return num_experts, hidden, experts.down_proj.size(2)


def model_eos(model: torch.nn.Module) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
