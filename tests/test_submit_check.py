"""The one validation pass refuses what the model build refuses: a boost run with pipeline
parallelism whose sequence length does not divide by TP (its stages exchange the [s, b, d/t]
shard as an [s/t, b, d] buffer) stops at `pretrain_lowrank.py --check`, so submit.sh refuses
it before sbatch instead of the job failing after its queue wait.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_boost.config.run import load_run_config

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.yaml")


@pytest.mark.fast
@pytest.mark.parametrize("mode,tp,pp,seq,refused", [
    ("boost", 2, 2, 33, True),
    ("boost", 2, 2, 32, False),
    ("boost", 2, 1, 33, False),   # no pipeline: no p2p buffer to size
    ("naive", 2, 2, 33, False),   # a replicated stream is exchanged whole
])
def test_the_validation_pass_refuses_what_the_model_drive_refuses(mode, tp, pp, seq, refused):
    from megatron_boost.config.transformer import BoostTransformerConfig
    import torch

    from megatron_boost.model.gpt import schedule_seq_length

    overrides = [f"parallel.mode={mode}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                 f"model.seq_length={seq}"]
    layer_cfg = BoostTransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, tp_mode=mode,
        attn_rank=16, mlp_rank=16, add_bias_linear=False, pipeline_dtype=torch.float32)
    if refused:
        with pytest.raises(ValueError, match=rf"seq_length \({seq}\) must be divisible by "
                                             rf"tensor_model_parallel_size \({tp}\)"):
            schedule_seq_length(layer_cfg, seq)
        with pytest.raises(ValueError, match=rf"^model\.seq_length \({seq}\) must be divisible "
                                             rf"by tensor_model_parallel_size \({tp}\) for boost "
                                             rf"with pipeline parallelism"):
            load_run_config(DEBUG, overrides)  # loading runs the validation pass
    else:
        schedule_seq_length(layer_cfg, seq)
        load_run_config(DEBUG, overrides)


def test_submit_refuses_the_sequence_before_sbatch(tmp_path):
    """docs/sizing.md's rule table: this rule is checked at submission like the others."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "sbatch-args"
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\n')
    (bin_dir / "sbatch").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("NPROC_PER_NODE", "MBOOST_DEVICE", "PYTHON_ENV")}
    env.update(PATH=f"{bin_dir}:{Path(sys.executable).parent}:{env['PATH']}",
               PYTHONPATH=str(REPO), MBOOST_DEVICE="cpu", NPROC_PER_NODE="4")
    proc = subprocess.run(
        [str(REPO / "scripts/slurm/submit.sh"), "configs/debug.yaml", "parallel.tp=2",
         "parallel.pp=2", "model.seq_length=33", f"logging.run_dir={tmp_path / 'run'}"],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: model.seq_length (33) must be divisible by tensor_model_parallel_size (2)"), lines
    assert not record.exists(), "submitted despite the error"
    sizing = " ".join((REPO / "docs" / "sizing.md").read_text().split())
    assert "(checked when the model is built)" not in sizing
