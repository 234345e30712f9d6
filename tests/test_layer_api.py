"""The layer's public behaviour a newcomer meets first: device errors, what ``describe()`` says,
forward-only inputs, and backends found by discovering the package's modules."""

from __future__ import annotations

import pkgutil
import warnings

import pytest
import torch

import ep_runtime.dispatch
import ep_runtime.experts
from ep_runtime import EPInputError, EPMoE, MoEConfig
from ep_runtime.config import DEFAULT_MAX_TOKENS_PER_RANK, EXACT_MODE_TOKENS_HINT
from ep_runtime.dispatch import DISPATCHERS
from ep_runtime.dispatch.protocol import fingerprint_of
from ep_runtime.experts import EXPERTS

CFG = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, dtype=torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_device_without_cuda_names_the_argument() -> None:
    with pytest.raises(EPInputError, match=r"^device: expected a device this torch can use"):
        EPMoE(CFG, device="cuda")


def test_describe_says_why_the_chosen_backend_won_over_runnable_ones() -> None:
    layer = EPMoE(CFG, device="cpu")
    try:
        text = layer.choice.describe()
    finally:
        layer.close()
    assert text.splitlines()[0] == "dispatcher=local experts=grouped_mm layout=expanded"
    assert "passed over experts:reference: runs here too; grouped_mm ranks higher" in text
    assert "passed over dispatcher:torch_a2a: runs here too; local ranks higher" in text
    assert "refused experts:flashinfer_trtllm: runs on ['cuda'], not cpu" in text


def test_inputs_that_require_grad_warn_once() -> None:
    layer = EPMoE(CFG, experts="reference", device="cpu")
    layer.load_weights(torch.randn(4, 16, 16), torch.randn(4, 16, 8))
    x = torch.randn(3, 16, requires_grad=True)
    ids = torch.tensor([[0, 1], [2, -1], [3, 1]])
    weights = torch.rand(3, 2)
    try:
        with pytest.warns(UserWarning, match="forward-only .* x requires grad"):
            out = layer(x, ids, weights)
        assert not out.requires_grad
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            layer(x, ids, weights)  # once per layer
    finally:
        layer.close()


@pytest.mark.parametrize(
    ("package", "registry"), [(ep_runtime.dispatch, DISPATCHERS), (ep_runtime.experts, EXPERTS)]
)
def test_every_backend_module_registers_itself(package, registry) -> None:
    """Adding a backend is adding a file: every module of the package was imported, and every
    backend class defined in one is in the registry."""
    for module in pkgutil.iter_modules(package.__path__):
        name = f"{package.__name__}.{module.name}"
        imported = __import__(name, fromlist=["_"])
        backends = [
            value
            for value in vars(imported).values()
            if isinstance(value, type) and value.__module__ == name and "name" in vars(value)
        ]
        for backend in backends:
            assert registry[backend.name] is backend
    assert {"torch_a2a", "deepep_v2", "torch_symm_mem"} <= set(DISPATCHERS.names())


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(mode="capacity", layout="standard", max_tokens_per_rank=8, poison=True),
        dict(dispatcher="torch_a2a", experts="reference", layout="expanded"),
        dict(mode="capacity"),
        dict(max_tokens_per_rank=8),
    ],
)
def test_the_agreed_settings_are_every_option_once(options) -> None:
    """The settings ranks agree on (and the fingerprint in each header) are every field of the
    layer's spec, its config's by name, written out here by hand from the arguments."""
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8)  # dtype None
    layer = EPMoE(config, device="cpu", **options)
    try:
        expected = {
            "num_experts": "4",
            "top_k": "2",
            "hidden_size": "16",
            "intermediate_size": "8",
            "activation": "silu",
            "dtype": "torch.float32",  # None resolves to fp32 on CPU
            # capacity mode's cap defaults to 256; exact mode has no bound unless one is given
            "max_tokens_per_rank": str(
                options.get(
                    "max_tokens_per_rank", 256 if options.get("mode") == "capacity" else None
                )
            ).lower(),
            "mode": options.get("mode", "exact"),
            "layout": options.get("layout", "auto"),
            "dispatcher": options.get("dispatcher", "auto"),
            "experts": options.get("experts", "auto"),
            "poison": str(options.get("poison", False)),
            "quantization": "none",
            "num_redundant_experts": "0",
            "eplb_interval": "none",
            "device_checks": str(options.get("device_checks", False)),
            "elastic": "False",
        }
        assert layer.spec.settings() == expected
        # the headers carry the settings and the placement (a rebalance changes the latter)
        placement = layer.placement.fingerprint()
        assert layer.identity.fingerprint == fingerprint_of(
            {"settings": fingerprint_of(expected), "placement": placement}
        )
    finally:
        layer.close()


@pytest.mark.parametrize(
    ("mode", "cap", "expected", "experts_tokens"),
    [
        ("capacity", None, DEFAULT_MAX_TOKENS_PER_RANK, DEFAULT_MAX_TOKENS_PER_RANK),
        ("capacity", 8, 8, 8),
        ("exact", 8, 8, 8),
        ("exact", None, None, EXACT_MODE_TOKENS_HINT),  # no bound: experts assume a prefill
    ],
)
def test_the_cap_is_one_value_for_the_layer_its_dispatcher_and_its_experts(
    mode, cap, expected, experts_tokens
) -> None:
    assert CFG.max_tokens_per_rank is None
    layer = EPMoE(CFG, experts="reference", mode=mode, max_tokens_per_rank=cap, device="cpu")
    try:
        assert layer.max_tokens_per_rank == expected
        assert layer.dispatcher.setup.max_tokens_per_rank == expected
        assert layer.experts.setup.token_cap == experts_tokens
        if mode == "exact":
            assert layer.rounds.fixed == expected
    finally:
        layer.close()
