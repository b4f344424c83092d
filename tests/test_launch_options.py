"""The launcher's options for a job that runs it once per node (scripts/slurm/pretrain.sbatch):
a rendezvous endpoint and id also on one node, and another trainer script, launched without
the launcher's configuration check (its configuration is its own). The Slurm job itself runs
in tests/test_slurm.py and tests/test_slurm_training.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_boost.cli.launch import parse_args, torchrun_args

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.fast
def test_a_jobs_launch_is_c10d_with_its_id_and_entry():
    args = parse_args(["--nproc-per-node", "2", "--rdzv-endpoint", "n1:20007", "--rdzv-id",
                       "7-0", "--entry", "/x/trainer.py", "--config", "cfg.yaml", "a.b=1"])
    assert torchrun_args(args) == [
        "--nnodes=1", "--node-rank=0", "--rdzv-backend=c10d", "--rdzv-endpoint=n1:20007",
        "--rdzv-id=7-0", "--nproc-per-node=2", "--signals-to-handle=SIGHUP,SIGQUIT",
        "/x/trainer.py", "--config", "cfg.yaml", "a.b=1"]
    one_node = torchrun_args(parse_args(["--nproc-per-node", "1", "--config", "c.yaml"]))
    assert one_node[0] == "--standalone" and one_node[-3].endswith("pretrain_lowrank.py")


def test_another_entry_is_launched_without_the_config_check(tmp_path):
    """A config the project's check refuses reaches another script, which runs (the launcher
    checks only pretrain_lowrank.py's configuration)."""
    script = tmp_path / "other_trainer.py"
    script.write_text("import sys\nopen(sys.argv[2] + '.ran', 'w').write(' '.join(sys.argv))\n")
    config = tmp_path / "own.yaml"
    config.write_text("not_a_section: 1\n")
    proc = subprocess.run([sys.executable, "-m", "megatron_boost.cli.launch",
                           "--nproc-per-node", "1", "--entry", str(script),
                           "--config", str(config), "k=v"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "own.yaml.ran").read_text().endswith("own.yaml k=v")


@pytest.mark.parametrize("where,env,lines", [
    (["--node-rank", "0"], {}, 1),
    (["--node-rank", "1"], {}, 0),
    ([], {"SLURM_NODEID": "1"}, 0),  # a Slurm step leaves the node rank to the rendezvous
    ([], {"SLURM_NODEID": "0"}, 1),
], ids=["node0", "node1", "slurm-node1", "slurm-node0"])
def test_a_config_error_is_one_line_for_the_whole_job(where, env, lines, monkeypatch, capsys):
    """Every node's launcher checks the same configuration: node 0's prints the error, the
    others exit 2 without a line, so a job of N nodes shows one line, not N."""
    from megatron_boost.cli.launch import main

    monkeypatch.delenv("SLURM_NODEID", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    status = main(["--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", "h:29500",
                   *where, "--config", str(REPO / "configs/debug.yaml"),
                   "training.train_iter=3"])
    err = capsys.readouterr().err
    assert status == 2
    assert len([ln for ln in err.splitlines() if ln.startswith("error:")]) == lines, err
    assert "Traceback" not in err
