"""The multi-rank suite at W = 1 on a transport defined in the tests
(tests/support/memory_transport.py): every (experts × layout × activation × mode) of the suite's
matrix
against ``reference_moe``, and the exact round trip."""

from __future__ import annotations

import pytest
import torch

from tests.multigpu import dispatch_cases, test_suite
from tests.multigpu.conftest import get_pool
from tests.multigpu.rank_inputs import CaseSpec
from tests.support.memory_transport import InMemoryTransport, register


@pytest.fixture
def pool():
    pool = get_pool(1)
    pool.run_ok(register)
    return pool


@pytest.mark.parametrize(
    "spec", list(test_suite.backend_matrix([InMemoryTransport.name])), ids=test_suite.case_id
)
def test_layer_matches_reference(pool, spec: CaseSpec) -> None:
    test_suite.check_layer_matches_reference(pool, spec)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_round_trip_is_exact(pool, dtype, mode, layout) -> None:
    spec = CaseSpec(
        dispatcher=InMemoryTransport.name, layout=layout, mode=mode, dtype=dtype, top_k=4
    )
    assert sum(pool.run_ok(dispatch_cases.check_round_trip, spec)) > 0
