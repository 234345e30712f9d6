"""The layer tests every imitation-backed transport passes on gloo ranks, defined once.

``tests/dispatch/test_deepep_adapter.py`` and ``tests/dispatch/test_symm_mem_dispatcher.py`` each
bind the suite to
their imitation (``globals().update(imitation_suite(...))``): the layer against
``reference_moe`` over world sizes, modes, layouts and experts, the edge cases, exact mode past
the cap, poison mode, and a bad input on one rank failing every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from tests.multigpu import checks, rank_inputs
from tests.multigpu.conftest import get_pool
from tests.multigpu.rank_inputs import CaseSpec

LAYOUTS = ("standard", "expanded")
MODES = ("exact", "capacity")


def imitation_suite(
    dispatcher: str,
    register: Callable[[], None],
    *,
    world_sizes: tuple[int, ...],
    activations: tuple[str, ...] = ("silu",),
    skip_note: str = "",
) -> dict[str, Any]:
    """The ``imitation_pool`` fixture and the shared tests for ``dispatcher`` (registered in each
    rank by ``register``). ``skip_note`` ends the skip reason off gloo ranks."""

    @pytest.fixture
    def imitation_pool() -> Callable[[int], Any]:
        """A pool of gloo ranks with the imitation-backed dispatcher registered in each."""

        def get(world_size: int):
            pool = get_pool(world_size)
            if pool.backend != "gloo":
                pytest.skip(
                    f"the imitation runs on CPU (gloo) ranks, this pool is {pool.backend}"
                    + skip_note
                )
            pool.run_ok(register)
            return pool

        return get

    @pytest.mark.parametrize("world_size", world_sizes)
    @pytest.mark.parametrize("mode", MODES)
    @pytest.mark.parametrize("layout", LAYOUTS)
    @pytest.mark.parametrize("experts", ["reference", "grouped_mm"])
    @pytest.mark.parametrize("activation", activations)
    def test_layer_matches_reference(imitation_pool, world_size, mode, layout, experts, activation):
        spec = CaseSpec(
            dispatcher=dispatcher, experts=experts, layout=layout, mode=mode, activation=activation
        )
        checks.run_layer_cases(imitation_pool(world_size), spec)

    @pytest.mark.parametrize("mode", MODES)
    @pytest.mark.parametrize("layout", LAYOUTS)
    @pytest.mark.parametrize("edge", list(rank_inputs.EDGE_CASES))
    def test_edge_cases(imitation_pool, edge, layout, mode):
        spec = CaseSpec(dispatcher=dispatcher, experts="grouped_mm", layout=layout, mode=mode)
        checks.run_layer_cases(
            imitation_pool(2), rank_inputs.with_spec(spec, **rank_inputs.EDGE_CASES[edge])
        )

    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_exact_mode_chunks_past_the_cap(imitation_pool, layout):
        """Rank 0 needs 3 chunks, rank 1 one: rank 1 keeps dispatching empty slices."""
        spec = CaseSpec(dispatcher=dispatcher, layout=layout, **rank_inputs.CHUNKED_PAST_CAP)
        checks.run_layer_cases(imitation_pool(2), spec)

    @pytest.mark.parametrize("mode", MODES)
    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_poison_mode_matches_clean_run(imitation_pool, mode, layout):
        pool = imitation_pool(2)
        spec = CaseSpec(dispatcher=dispatcher, experts="grouped_mm", layout=layout, mode=mode)
        checks.assert_poison_matches_clean(partial(checks.run_layer_cases, pool), spec)

    @pytest.mark.parametrize(("fault", "mode"), checks.BAD_INPUTS)
    def test_bad_input_on_one_rank_fails_every_rank(imitation_pool, fault, mode):
        pool = imitation_pool(2)
        spec = CaseSpec(dispatcher=dispatcher, experts="grouped_mm")
        run = partial(checks.run_layer_cases, pool)
        checks.assert_bad_input_fails_every_rank(pool, run, spec, fault, mode)

    return {
        "imitation_pool": imitation_pool,
        "test_layer_matches_reference": test_layer_matches_reference,
        "test_edge_cases": test_edge_cases,
        "test_exact_mode_chunks_past_the_cap": test_exact_mode_chunks_past_the_cap,
        "test_poison_mode_matches_clean_run": test_poison_mode_matches_clean_run,
        "test_bad_input_on_one_rank_fails_every_rank": test_bad_input_on_one_rank_fails_every_rank,
    }
