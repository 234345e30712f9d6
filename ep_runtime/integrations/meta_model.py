"""The model of a config without its weights: every parameter on the meta device (shape and
dtype, no storage), buffers real; what ``load_sharded`` fills from a checkpoint, and what the
launcher checks a checkpoint's metadata against before any rank starts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ep_runtime.integrations.transformers import require_transformers


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device (shape and dtype, no storage);
    buffers stay real, so what a module computes at construction (rotary tables) is kept. A
    parameter exists on the CPU only until it is registered (the supported models create their
    large ones with ``torch.empty``: no page is touched). Patches ``nn.Module`` for the duration:
    build nothing else in another thread meanwhile."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_empty_model(config: Any, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config``, parameters on the meta device in their load dtypes
    (transformers' own, e.g. DeepSeek's fp32 routers), buffers on the CPU."""
    hf = require_transformers()
    with parameters_on_meta():
        model = hf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
