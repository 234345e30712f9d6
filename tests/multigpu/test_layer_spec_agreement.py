"""A new layer option is agreed between ranks by construction: a ``LayerSpec`` (or ``MoEConfig``)
with one more field, different on two ranks, is refused at build with an ``EPInputError`` naming
the field and each rank's value, before any forward; the same value on both ranks builds and
runs, with the option in the layer's fingerprint. No agreement code knows the field."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import ep_runtime.layer
from ep_runtime import EPInputError, EPMoE, MoEConfig, reference_moe
from ep_runtime.layer_spec import LayerSpec
from ep_runtime.tolerance import compare_per_token, tolerance_for
from tests.multigpu.rank_inputs import CaseSpec, device, make_inputs, make_weights

OPTION = "flavour"  # the added field
SPEC = CaseSpec(experts="reference", dtype=torch.float32, num_experts=4, top_k=2, hidden=16)


def _with_option(base: type, value: str) -> type:
    """``base`` (a frozen dataclass) with one more field, ``flavour``, defaulting to ``value``."""
    return dataclasses.make_dataclass(
        f"{base.__name__}WithFlavour",
        [(OPTION, str, dataclasses.field(default=value))],
        bases=(base,),
        frozen=True,
    )


def build_with_option(where: str, values: list[str]) -> dict:
    """On this rank: build an ``EPMoE`` whose spec (``where="spec"``) or config
    (``where="config"``) has the extra field set to ``values[rank]``; run one forward if it
    builds. Returns how the build ended, the fingerprint and the forward's error vs the oracle."""
    rank = dist.get_rank()
    config = SPEC.config()
    spec_class = LayerSpec
    if where == "config":
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(MoEConfig)}
        config = _with_option(MoEConfig, values[rank])(**fields)
    else:
        spec_class = _with_option(LayerSpec, values[rank])
    try:
        with mock.patch.object(ep_runtime.layer, "LayerSpec", spec_class):
            layer = EPMoE(config, dispatcher=SPEC.dispatcher, experts=SPEC.experts, device=device())
    except EPInputError as error:
        return {"error": (error.argument, error.expected, error.given)}
    try:
        w13, w2 = make_weights(SPEC)
        layer.load_weights(w13, w2)
        x, ids, weights = make_inputs(SPEC, rank)
        out = layer(x.to(layer.device), ids.to(layer.device), weights.to(layer.device))
        expected = reference_moe(x, ids, weights, w13, w2, SPEC.activation)
        plain = LayerSpec.of(
            SPEC.config(), layer.device, dispatcher=SPEC.dispatcher, experts=SPEC.experts
        )
        tolerance = tolerance_for(SPEC.dtype, max(SPEC.hidden, SPEC.intermediate))
        return {
            "error": None,
            "settings": layer.spec.settings(),
            "fingerprint": layer.identity.fingerprint,
            "plain_fingerprint": plain.fingerprint(),
            "forward_ok": compare_per_token(out.cpu(), expected, tolerance).passed,
        }
    finally:
        layer.close()


@pytest.mark.parametrize("where", ["spec", "config"])
def test_an_added_option_that_differs_between_ranks_is_refused(pool_factory, where) -> None:
    results = pool_factory(2).run_ok(build_with_option, where, ["sweet", "sour"])
    for result in results:
        assert result["error"] == (
            OPTION,
            "the same value on every rank",
            "rank 0 = sweet, rank 1 = sour",
        ), result


@pytest.mark.parametrize("where", ["spec", "config"])
def test_an_added_option_equal_on_every_rank_builds_and_is_fingerprinted(
    pool_factory, where
) -> None:
    results = pool_factory(2).run_ok(build_with_option, where, ["sweet", "sweet"])
    for result in results:
        assert result["error"] is None, result
        assert result["settings"][OPTION] == "sweet", result
        assert result["fingerprint"] != result["plain_fingerprint"], result
        assert result["forward_ok"], result
    assert results[0]["fingerprint"] == results[1]["fingerprint"]
