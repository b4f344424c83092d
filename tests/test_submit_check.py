"""The one validation pass refuses what the model build refuses: a boost run with pipeline
parallelism whose sequence length does not divide by TP (its stages exchange the [s, b, d/t]
shard as an [s/t, b, d] buffer) stops at `pretrain_lowrank.py --check`, so submit.sh refuses
it before sbatch instead of the job failing after its queue wait.
"""

from __future__ import annotations

import math
import os
import re
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


# ---- submit.sh --dry-run, --help and the pre-emption signal's lead time ---------------------

SUBMIT = REPO / "scripts" / "slurm" / "submit.sh"
SBATCH = REPO / "scripts" / "slurm" / "pretrain.sbatch"


@pytest.fixture
def submit(tmp_path):
    """Runs submit.sh with a stand-in sbatch on PATH that records its arguments; returns
    (run(*args, **env) -> CompletedProcess, the record file)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "sbatch-args"
    (bin_dir / "sbatch").write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\necho "Submitted batch job 42"\n')
    (bin_dir / "sbatch").chmod(0o755)
    base = {k: v for k, v in os.environ.items()
            if k not in ("NPROC_PER_NODE", "MBOOST_DEVICE", "PYTHON_ENV", "CKPT_WRITE_MIB_S",
                         "SRUN_ARGS", "TORCHRUN", "MASTER_PORT", "OMP_NUM_THREADS")
            and not k.startswith("SLURM_")}
    base.update(PATH=f"{bin_dir}:{Path(sys.executable).parent}:{base['PATH']}",
                PYTHONPATH=str(REPO))

    def run(*args, **env):
        return subprocess.run([str(SUBMIT), *map(str, args)], env={**base, **env},
                              capture_output=True, text=True, timeout=300)
    return run, record


def lead_seconds(*overrides, write_mib_s=None):
    from megatron_boost.cli.checkpoint_cost import save_estimate

    cfg = load_run_config(DEBUG, list(overrides))
    return save_estimate(cfg, *([write_mib_s] if write_mib_s else []))


def test_dry_run_prints_the_submission_and_each_nodes_launch_without_sbatch(submit, tmp_path):
    run, record = submit
    run_dir = f"logging.run_dir={tmp_path / 'run'}"
    proc = run("--dry-run", "-N", "2", "--gpus-per-node=4", "--time=1:00:00",
               "configs/debug.yaml", "parallel.tp=2", "training.global_batch_size=8", run_dir,
               SRUN_ARGS="--container-image=img.sqsh", NCCL_SOCKET_IFNAME="ib0",
               TORCHRUN="apptainer exec --nv img.sif torchrun")
    assert proc.returncode == 0, proc.stderr
    assert not record.exists(), "sbatch was called by a dry run"
    assert not (tmp_path / "run").exists()
    out = proc.stdout
    assert "check passed: 8 processes = tp 2 x pp 1 x dp 4" in out, out
    lead = lead_seconds("parallel.tp=2")["lead_s"]
    assert (f"\n  sbatch --signal=B:USR1@{lead} -N 2 --gpus-per-node=4 --time=1:00:00 "
            f"scripts/slurm/pretrain.sbatch configs/debug.yaml parallel.tp=2 "
            f"training.global_batch_size=8 {run_dir}\n") in out
    srun = next(line for line in out.splitlines() if "] srun " in line)
    assert ("srun --kill-on-bad-exit=1 --nodes=2 --ntasks=2 --ntasks-per-node=1 "
            "--cpus-per-task=<node's CPUs> --export=ALL --container-image=img.sqsh "
            "apptainer exec --nv img.sif python -m megatron_boost.cli.launch --nnodes 2 "
            "--nproc-per-node 4 --rdzv-endpoint <first node>:<20000 + job id % 10000> "
            f"--rdzv-id <job id>-0 --entry {REPO}/pretrain_lowrank.py --config "
            f"configs/debug.yaml training.device=cuda parallel.tp=2 training.global_batch_size=8 "
            f"{run_dir}") in srun, srun
    assert re.search(r"environment: CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=<node's "
                     r"CPUs / 4> MASTER_ADDR=<first node> .*TORCH_ELASTIC_SHUTDOWN_TIMEOUT="
                     r"150", out), out
    assert "network settings: NCCL_SOCKET_IFNAME=ib0" in out


def test_dry_run_refuses_what_a_submission_refuses(submit, tmp_path):
    run, record = submit
    proc = run("--dry-run", "--gpus-per-node=3", "configs/debug.yaml", "parallel.tp=2",
               f"logging.run_dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: world size (3) must be divisible by parallel.tp")
    assert "dry run" not in proc.stdout and not record.exists()


def test_help_documents_every_option_and_variable(submit):
    run, record = submit
    proc = run("--help")
    assert proc.returncode == 0 and proc.stderr == "" and not record.exists()
    text = proc.stdout
    scripts = SUBMIT.read_text() + SBATCH.read_text()
    internal = set(re.findall(r"^([A-Z][A-Z0-9_]*)=", scripts, re.M))  # the scripts' own
    read = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*):[-+]", scripts))
    network = re.search(r"NETWORK_VARS=\((.*?)\)", SBATCH.read_text(), re.S).group(1).split()
    # Slurm's own variables, CUDA_VISIBLE_DEVICES as Slurm sets it, and submit.sh's hand-off
    # to pretrain.sbatch are not the user's to set.
    users = {v for v in read | set(network) if not v.startswith("SLURM_")} - internal - {
        "CUDA_VISIBLE_DEVICES", "MBOOST_DRY_RUN"}
    assert {"SRUN_ARGS", "TORCHRUN", "MBOOST_DEVICE", "NPROC_PER_NODE", "CKPT_WRITE_MIB_S",
            "NCCL_SOCKET_IFNAME"} <= users
    missing = sorted(v for v in users if not re.search(rf"\b{v}\b", text))
    assert missing == [], missing
    options = set(re.findall(r"^        (--[a-z-]+)\)", SUBMIT.read_text(), re.M))
    options |= {"--dry-run", "--help", "--nodes", "--gpus-per-node", "--gres",
                "--cpus-per-task", "--signal"}
    assert sorted(o for o in options if o not in text) == []


def test_the_signal_lead_time_follows_the_estimated_save(submit, tmp_path):
    """Without --signal the job gets the lead time of the config's estimated save (longer than
    pretrain.sbatch's 180 s when the save is); a shorter --signal is kept, with one warning."""
    run, record = submit
    run_dir = f"logging.run_dir={tmp_path / 'run'}"
    shard_mib = lead_seconds()["gib"] * 1024
    rate = shard_mib / 400  # a file system on which one rank's save takes 400 s
    est = lead_seconds(write_mib_s=rate)
    assert est["lead_s"] > 400 > 180
    env = dict(MBOOST_DEVICE="cpu", CKPT_WRITE_MIB_S=repr(rate))
    proc = run("configs/debug.yaml", run_dir, **env)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert record.read_text().splitlines()[0] == f"--signal=B:USR1@{est['lead_s']}"
    assert f"estimated checkpoint save {math.ceil(est['save_s'])} s" in proc.stdout

    proc = run("--signal=B:USR1@60", "configs/debug.yaml", run_dir, **env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"warning: --signal lead time 60 s is shorter than the estimated checkpoint save "
        f"{math.ceil(est['save_s'])} s"), lines
    assert f"--signal=B:USR1@{est['lead_s']}" in lines[0]
    assert record.read_text().splitlines()[0] == "--signal=B:USR1@60"

    proc = run("--signal", f"B:USR1@{est['lead_s']}", "configs/debug.yaml", run_dir, **env)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert record.read_text().splitlines()[:2] == ["--signal", f"B:USR1@{est['lead_s']}"]
