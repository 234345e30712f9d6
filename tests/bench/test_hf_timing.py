"""bench.hf's timing helpers on CPU: the rows' calls interleaved with their set-up untimed, the
per-block host clock's count, and the refusal of rows that cannot all fit on the device."""

from __future__ import annotations

import pytest
import torch

from ep_runtime.bench import hf_timing

CPU = torch.device("cpu")


def test_rows_are_timed_in_turn_with_their_set_up_before_each_call() -> None:
    calls: list[str] = []

    def row(name: str) -> hf_timing.Timed:
        return (lambda: calls.append(f"prepare {name}"), lambda: calls.append(name))

    medians = hf_timing.interleaved_medians({"a": row("a"), "b": row("b")}, CPU, iters=3, warmup=1)
    assert set(medians) == {"a", "b"} and all(m >= 0 for m in medians.values())
    warmups = ["prepare a", "a", "prepare b", "b"]
    assert calls == warmups + ["prepare a", "a", "prepare b", "b"] * 3


def test_the_block_clock_counts_each_block_forward_and_unhooks() -> None:
    blocks = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    x = torch.randn(2, 4)
    with hf_timing.BlockHostClock(blocks) as clock:
        for _ in range(3):
            for block in blocks:
                block(x)
    assert clock.calls == 6 and clock.seconds > 0
    assert clock.microseconds_per_forward == pytest.approx(clock.seconds / 6 * 1e6)
    blocks[0](x)  # the hooks are gone
    assert clock.calls == 6


def test_rows_that_cannot_all_fit_are_refused_naming_the_figures(monkeypatch) -> None:
    model = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB of fp32
    monkeypatch.setattr(hf_timing, "free_device_bytes", lambda _device: 10 << 20)
    hf_timing.check_room_for_rows(model, 2, CPU)  # 8 MiB fit in 10
    with pytest.raises(SystemExit, match=r"3 patched rows hold a model each, 0\.0 GiB"):
        hf_timing.check_room_for_rows(model, 3, CPU)
    monkeypatch.setattr(hf_timing, "free_device_bytes", lambda _device: None)  # off CUDA
    hf_timing.check_room_for_rows(model, 100, CPU)
