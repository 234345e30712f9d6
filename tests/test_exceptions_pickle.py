"""Every exception class the package defines survives pickling (Ray and multiprocessing carry a
rank's error to the launcher that way): same type, same fields, same message. A new exception
class without an example here fails the completeness check."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

import ep_runtime
from ep_runtime.dispatch.deepep_v2 import DeepEPUnavailableError
from ep_runtime.elastic import CountedOutError, LostExpertsError, RecoveryError
from ep_runtime.integrations.transformers import UnsupportedMoEBlockError
from ep_runtime.launch.spec import LaunchError, RankFailure
from ep_runtime.types import (
    BackendUnavailableError,
    ClosedError,
    EPInputError,
    ForwardMismatchError,
    GroupUnusableError,
    RemoteRankError,
)

EXAMPLES: dict[type[BaseException], BaseException] = {
    EPInputError: EPInputError("hidden_size", "a positive int", 0),
    BackendUnavailableError: BackendUnavailableError(
        "dispatcher", "nope", {"nope": "unknown; registered: torch_a2a", "deepep_v2": "no GPU"}
    ),
    RemoteRankError: RemoteRankError(3, "EPInputError: topk_ids: expected ..."),
    ClosedError: ClosedError("layer used after close()"),
    RankFailure: RankFailure(1, "raised during step setup", "Traceback ...", "EPInputError: x"),
    LaunchError: LaunchError("--address auto: expected a running Ray cluster, given none"),
    DeepEPUnavailableError: DeepEPUnavailableError("deep_ep 1.0 has no ElasticBuffer"),
    ForwardMismatchError: ForwardMismatchError(
        {1: "runs layer 1 (settings 0x1f)"}, "rank 0 is in dispatch of forward #4 of layer 0"
    ),
    GroupUnusableError: GroupUnusableError("all_to_all: the group's store is unreachable"),
    CountedOutError: CountedOutError("this rank (original rank 2) joined generation 1 late"),
    LostExpertsError: LostExpertsError(3, (4, 5)),
    RecoveryError: RecoveryError("recovery gave up after 30 s: forming generation 3 failed"),
    UnsupportedMoEBlockError: UnsupportedMoEBlockError(
        "model.layers.0.mlp", "a Qwen3-MoE, Mixtral or DeepSeek-V2/V3 block", "FooMoEBlock"
    ),
}


def _package_exception_classes() -> set[type[BaseException]]:
    """Every exception class defined in a module of ``ep_runtime`` (found by importing them)."""
    found = set()
    for module_info in pkgutil.walk_packages(ep_runtime.__path__, "ep_runtime."):
        if module_info.name.endswith("__main__"):  # running it would start a launcher
            continue
        try:
            module = importlib.import_module(module_info.name)
        except ModuleNotFoundError as missing:  # an extra's module; CI installs every extra
            if missing.name != "ray":
                raise
            pytest.skip(f"ray is not installed ({module_info.name} needs it)")
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
            ):
                found.add(value)
    return found


def test_every_package_exception_has_an_example():
    assert _package_exception_classes() <= set(EXAMPLES)


@pytest.mark.parametrize("error", list(EXAMPLES.values()), ids=lambda e: type(e).__name__)
def test_round_trip_keeps_type_fields_and_message(error):
    error.add_note("a note added where it was raised")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert copy.args == error.args
    assert vars(copy) == vars(error)  # the named fields, and the note


def test_fields_are_the_constructor_arguments():
    """Checked by hand for the classes with fields, so the round trip compares real values."""
    copy = pickle.loads(pickle.dumps(EXAMPLES[EPInputError]))
    assert (copy.argument, copy.expected, copy.given) == ("hidden_size", "a positive int", 0)
    assert str(copy) == "hidden_size: expected a positive int, given 0"
    copy = pickle.loads(pickle.dumps(EXAMPLES[BackendUnavailableError]))
    assert copy.refusals["deepep_v2"] == "no GPU" and copy.requested == "nope"
    copy = pickle.loads(pickle.dumps(EXAMPLES[RemoteRankError]))
    assert copy.rank == 3 and str(copy).startswith("rank 3 failed: EPInputError")
    copy = pickle.loads(pickle.dumps(EXAMPLES[RankFailure]))
    assert (copy.rank, copy.usage_error) == (1, "EPInputError: x")
