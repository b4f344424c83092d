"""Checkpoints written when every B factor was a parameter of its own load into the layers'
grouped B (docs/design.md §4) and resume exactly: the checkpoint keys (B_q, ..., B_down, and
the optimizer state under them) are the same, through the grouped factor's
ShardedTensorFactory. The fixtures (tests/fixtures/legacy_checkpoint/README.md) were written by
commit 5398f43 with and without the distributed optimizer; each is resumed at TP=2 as its
user would relaunch it, and its losses at iterations 4 and 5 must be those of the same run
never interrupted.

Tolerance: relative 1e-5. fp32 on the CPU; the current layers compute the same function as
those that wrote the checkpoint with another rounding order (the norm's γ folded into A, the
statistic's gradient added in one kernel), which may move the last bits (here, megatron-core
0.16.1 and torch 2.13, the losses came out equal), while a factor loaded into the wrong rows,
or an optimizer state lost, moves the loss by 1e-2 or more (pieces loaded in reversed order:
4.8344 against 4.7703 at iteration 4).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.test_training import losses, run_training

# The full suite only (docs/testing.md): the fixtures' uninterrupted losses are megatron-core
# 0.16's, whose synthetic data and draws 0.19's differ from, so the compatibility tier could not
# compare them.

FIXTURES = Path(__file__).parent / "fixtures" / "legacy_checkpoint"
ARGS = ["parallel.tp=2", "model.num_layers=1", "model.hidden_size=32", "model.ffn_hidden_size=64",
        "model.num_attention_heads=2", "model.num_query_groups=2", "model.attn_rank=8",
        "model.mlp_rank=8", "model.vocab_size=128", "model.seq_length=16",
        "training.train_iters=5", "training.global_batch_size=4", "logging.log_interval=1"]


@pytest.mark.parametrize("optimizer,distributed", [("adamw", "false"), ("dist", "true")])
def test_a_checkpoint_of_per_projection_b_factors_resumes_exactly(tmp_path, optimizer,
                                                                  distributed):
    run_dir = tmp_path / optimizer
    shutil.copytree(FIXTURES / optimizer / "checkpoints", run_dir / "checkpoints")
    proc = run_training(2, ARGS + [f"parallel.use_distributed_optimizer={distributed}",
                                   f"logging.run_dir={run_dir}"])
    assert "at iteration 3" in proc.stdout and "optimizer state loaded" in proc.stdout, \
        proc.stdout[-2000:]
    straight = {r["iteration"]: r["loss"]
                for r in json.loads((FIXTURES / optimizer / "straight_losses.json").read_text())}
    got = losses(run_dir)
    assert sorted(got) == [4, 5]
    for it in (4, 5):
        assert got[it] == pytest.approx(straight[it], rel=1e-5), (it, got[it], straight[it])
