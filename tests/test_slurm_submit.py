"""scripts/slurm/submit.sh: the configuration and data are checked for the requested layout
before sbatch, so a typo fails at once with one error line instead of after the queue wait.

sbatch is a stand-in on PATH that records its arguments (the real cluster runs the submitted
script in tests/test_slurm.py and tests/test_slurm_training.py); what is tested here is whether
and what submit.sh submits.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUBMIT = REPO / "scripts" / "slurm" / "submit.sh"


@pytest.fixture
def fake_sbatch(tmp_path):
    """A PATH whose sbatch records its arguments (one per line) in tmp_path/sbatch-args."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "sbatch-args"
    (bin_dir / "sbatch").write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\necho "Submitted batch job 42"\n')
    (bin_dir / "sbatch").chmod(0o755)
    python_dir = str(Path(sys.executable).parent)  # the environment's python for --check
    env = {k: v for k, v in os.environ.items()
           if k not in ("NPROC_PER_NODE", "MBOOST_DEVICE", "PYTHON_ENV")}
    env.update(PATH=f"{bin_dir}:{python_dir}:{env['PATH']}", PYTHONPATH=str(REPO))
    return env, record


def submit(env, *args, **extra_env):
    return subprocess.run([str(SUBMIT), *map(str, args)], env={**env, **extra_env},
                          capture_output=True, text=True, timeout=300)


def signal_option(config, *overrides):
    """The --signal submit.sh adds: the lead time tools/checkpoint_cost.py --estimate proposes
    for the job's configuration."""
    from megatron_boost.cli.checkpoint_cost import save_estimate
    from megatron_boost.config.run import load_run_config

    lead = save_estimate(load_run_config(str(REPO / config), list(overrides)))["lead_s"]
    return f"--signal=B:USR1@{lead}"


def _one_error_line(proc, *words):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_a_typo_fails_before_sbatch(fake_sbatch, tmp_path):
    env, record = fake_sbatch
    proc = submit(env, "--nodes=2", "--gpus-per-node=4", "configs/debug.yaml",
                  "trainig.train_iters=4", f"logging.run_dir={tmp_path / 'run'}")
    _one_error_line(proc, "unknown section 'trainig'")
    assert not record.exists(), "submitted despite the error"


def test_the_layout_is_checked_for_the_requested_world_size(fake_sbatch, tmp_path):
    env, record = fake_sbatch
    # 1 node × 3 GPUs: TP=2 does not divide the world size 3
    proc = submit(env, "-N", "1", "--gpus-per-node", "h100:3", "configs/debug.yaml",
                  "parallel.tp=2", f"logging.run_dir={tmp_path / 'run'}")
    _one_error_line(proc, "world size (3) must be divisible by parallel.tp")
    assert "world size 3" in proc.stdout
    assert not record.exists()


def test_every_model_shape_rule_is_checked_before_sbatch(fake_sbatch, tmp_path):
    env, record = fake_sbatch
    # a rule the layers enforce when the model is built, not a divisibility of the layout
    proc = submit(env, "--gpus-per-node=2", "configs/debug.yaml", "parallel.tp=2",
                  "model.attn_rank=null", "model.rank_ratio=2",
                  f"logging.run_dir={tmp_path / 'run'}")
    _one_error_line(proc, "attn_rank (128) must not exceed hidden_size (64)")
    assert not record.exists()


def test_missing_data_fails_before_sbatch(fake_sbatch, tmp_path):
    env, record = fake_sbatch
    proc = submit(env, "--gpus-per-node=1", "configs/debug.yaml", "data.mock=false",
                  f"data.data_path=[{tmp_path / 'corpus'}]",
                  f"data.tokenizer_model={tmp_path / 'tok.model'}",
                  f"logging.run_dir={tmp_path / 'run'}")
    _one_error_line(proc, str(tmp_path / "tok.model"))
    assert not record.exists()


def test_a_gpu_job_without_gpus_is_refused(fake_sbatch, tmp_path):
    env, record = fake_sbatch
    proc = submit(env, "configs/debug.yaml", f"logging.run_dir={tmp_path / 'run'}")
    _one_error_line(proc, "no GPUs requested", "--gpus-per-node")
    assert not record.exists()


def test_a_valid_job_is_submitted_unchanged(fake_sbatch, tmp_path):
    env, record = fake_sbatch
    args = ["--nodes", "1", "--time", "0:10:00", "--partition=cpu", "configs/debug.yaml",
            "parallel.tp=2", f"logging.run_dir={tmp_path / 'run'}"]
    proc = submit(env, *args, MBOOST_DEVICE="cpu", NPROC_PER_NODE="2")
    assert proc.returncode == 0, proc.stderr
    assert "world size 2" in proc.stdout and "Submitted batch job 42" in proc.stdout
    assert record.read_text().splitlines() == [
        signal_option(*args[5:]), *args[:5], "scripts/slurm/pretrain.sbatch", *args[5:]]
    assert (REPO / "logs").is_dir()  # pretrain.sbatch's --output directory


@pytest.mark.parametrize("args,env,words", [
    (["--cpus-per-task=1"], {"NPROC_PER_NODE": "2"}, ["--cpus-per-task 1", "at least 2"]),
    ([], {"SRUN_ARGS": "--container-image=x -N 2"}, ["SRUN_ARGS '-N'", "one torchrun per node"]),
    ([], {"GLOO_SOCKET_IFNAME": "^lo"}, ["GLOO_SOCKET_IFNAME '^lo'", "interface names"]),
    ([], {"TORCHRUN": "mpirun -np 2"}, ["TORCHRUN 'mpirun -np 2'", "must end in torchrun"]),
], ids=["cpus-per-task", "srun-args", "gloo-ifname", "torchrun"])
def test_the_launchers_settings_are_checked_before_sbatch(fake_sbatch, tmp_path, args, env,
                                                          words):
    fake_env, record = fake_sbatch
    proc = submit(fake_env, *args, "configs/debug.yaml", f"logging.run_dir={tmp_path / 'run'}",
                  MBOOST_DEVICE="cpu", **env)
    _one_error_line(proc, *words)
    assert not record.exists()


def test_container_and_network_settings_are_submitted(fake_sbatch, tmp_path):
    env, record = fake_sbatch
    proc = submit(env, "-c", "4", "configs/debug.yaml", f"logging.run_dir={tmp_path / 'run'}",
                  MBOOST_DEVICE="cpu", NPROC_PER_NODE="2", GLOO_SOCKET_IFNAME="eth0,eth1",
                  NCCL_SOCKET_IFNAME="^docker", SRUN_ARGS="--container-image=img.sqsh")
    assert proc.returncode == 0, proc.stderr
    assert record.read_text().splitlines()[:3] == [signal_option("configs/debug.yaml"), "-c", "4"]


SBATCH = REPO / "scripts" / "slurm" / "pretrain.sbatch"


@pytest.mark.parametrize("env,words", [
    ({}, ["not running under Slurm", "submit.sh"]),
    ({"SLURM_JOB_ID": "7", "PYTHON_ENV": "/nonexistent/venv"},
     ["PYTHON_ENV '/nonexistent/venv'", "bin/activate"]),
    ({"SLURM_JOB_ID": "7", "PRETRAIN_SCRIPT": "/nonexistent/train.py"},
     ["PRETRAIN_SCRIPT '/nonexistent/train.py'", "repository root"]),
], ids=["outside-slurm", "python-env", "entry-point"])
def test_the_job_scripts_own_refusals_are_one_error_line(tmp_path, env, words):
    """What the job script refuses before any step starts (run directly, as sbatch would run
    it on the first node) is one `error:` line and status 2, like every other bad input."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k not in ("PYTHON_ENV", "PRETRAIN_SCRIPT")}
    proc = subprocess.run(["bash", str(SBATCH), "configs/debug.yaml"],
                          env={**base, "SLURM_SUBMIT_DIR": str(REPO), **env}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    _one_error_line(proc, *words)
    assert proc.stdout == "", proc.stdout
