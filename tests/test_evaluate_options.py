"""``tools/evaluate.py --threads / --batch-size``: the default thread count follows the cores
this process may use, shared by the launch's processes; a batch of windows is one forward and
scores what one window at a time scores; the checkpoint path turns ``--batch-size`` into the
run's batch sizes; the threads reach torch."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from megatron_boost.cli import evaluate
from megatron_boost.convert.text_eval import hf_summed_loss, same_length_batches, text_windows


@pytest.mark.fast
def test_default_threads_share_this_process_cores_among_the_local_ranks(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # an idle machine
    assert evaluate.default_threads() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cores))  # more ranks than cores: one each
    assert evaluate.default_threads() == 1
    assert evaluate.parse_args(["m", "--input", "t"]).threads == 1


@pytest.mark.fast
def test_default_threads_leave_a_busy_machines_cores_alone(monkeypatch):
    """torch's threads wait on each other: on a machine busy with other work the default takes
    only the idle cores, at least one."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "getloadavg", lambda: (5.5, 0.0, 0.0))
    assert evaluate.default_threads() == 2
    monkeypatch.setattr(os, "getloadavg", lambda: (40.0, 0.0, 0.0))
    assert evaluate.default_threads() == 1


@pytest.mark.fast
def test_a_batch_of_windows_is_one_forward_and_scores_the_same():
    torch.manual_seed(0)
    table = torch.randn(50, 50)  # a "model": the logits of each position from its token
    calls = []

    def logits_fn(ids):  # [b, s] -> [b, s, V]
        calls.append(ids.shape)
        return table[ids]

    windows = text_windows(list(torch.randint(0, 50, (7 * 16 + 5,)).tolist()), 16)
    assert [len(w) for w in windows] == [16] * 7 + [5]
    batches = same_length_batches(windows, 3)
    assert [[len(w) for w in b] for b in batches] == [[16] * 3, [16] * 3, [16], [5]]
    batched = hf_summed_loss(logits_fn, batches)
    assert calls[0] == (3, 16) and len(calls) == 4
    one_at_a_time = hf_summed_loss(logits_fn, same_length_batches(windows, 1))
    assert batched == pytest.approx(one_at_a_time, rel=1e-6)


@pytest.mark.fast
def test_batch_size_of_a_checkpoint_is_one_micro_batch_per_data_parallel_rank():
    cfg = SimpleNamespace(parallel=SimpleNamespace(tp=2, pp=1))
    assert evaluate._batch_overrides(None, cfg, 4) == []
    assert evaluate._batch_overrides(6, cfg, 4) == ["training.micro_batch_size=6",
                                                    "training.global_batch_size=12"]


@pytest.mark.fast
def test_threads_reach_torch(monkeypatch, tmp_path):
    """evaluate() runs with torch's threads set to --threads, and restores the caller's."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        args = evaluate.parse_args([str(tmp_path), "--input", str(tmp_path / "absent.txt"),
                                    "--threads", "1"])
        monkeypatch.setattr(evaluate, "read_text", lambda path: "")
        monkeypatch.setattr(evaluate, "_evaluate_checkpoint",
                            lambda *a: {"threads": torch.get_num_threads()})
        assert evaluate.evaluate(args) == {"threads": 1}
        assert torch.get_num_threads() == 2  # the caller's setting is back
    finally:
        torch.set_num_threads(previous)
