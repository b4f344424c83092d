"""The real Slurm launcher (scripts/slurm/pretrain.sbatch) on a real, private Slurm cluster.

Uses tests/slurm_cluster.py (munged + slurmctld + slurmd started as root on this machine) and a
stand-in trainer written into tmp_path, since these tests are about the launcher: node/process
layout, rendezvous, exit codes, and the pre-emption signal -> checkpoint -> requeue -> resume
path. Skipped when Slurm is not installed or we are not root.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

try:
    from slurm_cluster import SlurmCluster, launcher_env, slurm_available
except ImportError:  # tests/ imported as a package
    from tests.slurm_cluster import SlurmCluster, launcher_env, slurm_available

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "scripts" / "slurm" / "pretrain.sbatch"

_OK, _WHY = slurm_available()
pytestmark = pytest.mark.skipif(not _OK, reason=f"no Slurm test cluster: {_WHY}")

# A stand-in for pretrain_lowrank.py with the same command line
# (--config <file> [key=value ...]). Overrides it understands:
#   run_dir=DIR            where it writes result/checkpoint files (required)
#   exit_code=N            exit N right after the first all-reduce
#   wait_for_signal=SECS   (fresh run) tick until SIGUSR1/SIGTERM arrives, then "checkpoint" and
#                          exit 0, as the trainer does; exit 4 if nothing arrives within SECS. A run that finds the
#                          checkpoint resumes and finishes at once.
STAND_IN = r'''
import argparse, json, os, signal, socket, subprocess, sys, time
from pathlib import Path

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--config", required=True)
p.add_argument("overrides", nargs="*")
args = p.parse_args()
ov = dict(o.split("=", 1) for o in args.overrides)
run_dir = Path(ov["run_dir"])
run_dir.mkdir(parents=True, exist_ok=True)

signals = []
def on_signal(signum, frame):
    signals.append(signal.Signals(signum).name)
signal.signal(signal.SIGUSR1, on_signal)
signal.signal(signal.SIGTERM, on_signal)

dist.init_process_group("gloo")  # env:// from torchrun
rank, world = dist.get_rank(), dist.get_world_size()
restart = os.environ.get("SLURM_RESTART_COUNT", "0")
ckpt = run_dir / "checkpoint.json"
resumed = ckpt.exists()
t = torch.tensor([float(rank)])
dist.all_reduce(t)

if "exit_code" in ov:
    dist.destroy_process_group()  # else gloo may abort the exit (SIGABRT) on one rank
    sys.exit(int(ov["exit_code"]))

if "wait_for_signal" in ov and not resumed:
    if rank == 0:
        (run_dir / f"started-{restart}").write_text(str(os.getpid()))
    deadline = time.time() + float(ov["wait_for_signal"])
    step = 0
    while time.time() < deadline:
        time.sleep(0.1)
        step += 1
        flag = torch.tensor([1.0 if signals else 0.0])
        dist.all_reduce(flag)  # all ranks agree to stop at the same step, like the trainer
        if flag.item() > 0:
            time.sleep(0.5)  # "saving"
            (run_dir / f"preempted-rank{rank}.json").write_text(
                json.dumps({"step": step, "signals": signals, "restart": restart}))
            dist.barrier()
            if rank == 0:
                ckpt.write_text(json.dumps({"step": step}))
            dist.barrier()
            dist.destroy_process_group()
            sys.exit(0)
    sys.exit(4)

def resolve(host):
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None

result = {
    "rank": rank,
    "world_size": world,
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "rank_sum": t.item(),
    "resumed": resumed,
    "restart": restart,
    "node": os.environ.get("SLURMD_NODENAME"),
    "node_id": os.environ.get("SLURM_NODEID"),
    "job_id": os.environ.get("SLURM_JOB_ID"),
    "resolved": {h: resolve(h) for h in ("n1", "n2")},
    "signals": signals,
    "config": args.config,
    "overrides": args.overrides,
    "env": {k: os.environ.get(k) for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "OMP_NUM_THREADS",
                                          "VIRTUAL_ENV", "SLURM_CPUS_PER_TASK",
                                          "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
                                          "NCCL_IB_HCA")},
    # the scheduler's record of this step (its name, tasks and CPUs), read while it runs
    "step": subprocess.run(
        ["scontrol", "show", "step",
         f"{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}"],
        capture_output=True, text=True).stdout if rank == 0 else None,
}
(run_dir / f"result-rank{rank}.json").write_text(json.dumps(result))
dist.destroy_process_group()
'''

@pytest.fixture
def slurm1(slurm_cluster_of):
    c = slurm_cluster_of(1)
    yield c
    c.cancel_all()


@pytest.fixture
def slurm2(slurm_cluster_of):
    c = slurm_cluster_of(2)
    yield c
    c.cancel_all()


@pytest.fixture
def job(tmp_path):
    """Submit directory (with logs/), config, run dir, stand-in trainer and job environment."""
    submit = tmp_path / "submit"
    (submit / "logs").mkdir(parents=True)
    (submit / "cfg.yaml").write_text("# stand-in config\n")
    trainer = tmp_path / "stand_in_trainer.py"
    trainer.write_text(STAND_IN)
    env = launcher_env(trainer)

    return SimpleNamespace(
        submit=submit,
        run_dir=tmp_path / "run",
        env=env,
        log=lambda job_id: _read(submit / "logs" / f"mboost-pretrain-{job_id}.out"),
    )


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError as e:
        return f"<{path}: {e.strerror}>"


def _results(run_dir: Path, world: int) -> list[dict]:
    files = sorted(run_dir.glob("result-rank*.json"))
    assert len(files) == world, f"expected {world} result files, got {[f.name for f in files]}"
    return sorted((json.loads(f.read_text()) for f in files), key=lambda r: r["rank"])


def _submit(cluster: SlurmCluster, job, overrides=(), env=None, sbatch_args=(), wait=True,
            timeout=90):
    e = dict(job.env)
    e.update(env or {})
    return cluster.sbatch(
        SBATCH,
        ["cfg.yaml", f"run_dir={job.run_dir}", *overrides],
        wait=wait,
        extra_sbatch_args=list(sbatch_args),
        env=e,
        cwd=job.submit,
        timeout=timeout,
    )


# First, so that the one-node tests here and in tests/test_slurm_training.py share a cluster
# (one runs at a time).
def test_two_nodes_one_process_each(slurm2, job):
    rc, job_id = _submit(slurm2, job, sbatch_args=["--nodes=2"])
    log = job.log(job_id)
    assert rc == 0, log
    results = _results(job.run_dir, 2)
    # one rank per node (c10d rendezvous may give rank 0 to either node)
    assert sorted((r["node"], r["node_id"]) for r in results) == [("n1", "0"), ("n2", "1")]
    for r in results:
        assert r["world_size"] == 2 and r["local_rank"] == 0
        assert r["rank_sum"] == 1.0
        assert r["resolved"] == {"n1": "127.0.0.1", "n2": "127.0.0.1"}
    # MASTER_ADDR is the first host of the allocation, and the rendezvous on it worked
    assert "rendezvous n1:" in log and "1 process(es)/node" in log, log


@pytest.mark.parametrize(
    "how", [{"NPROC_PER_NODE": "2"}, {"CUDA_VISIBLE_DEVICES": "0,1"}], ids=["NPROC_PER_NODE", "CUDA_VISIBLE_DEVICES"]
)
def test_one_node_two_processes(slurm1, job, how):
    rc, job_id = _submit(slurm1, job, ["model.hidden=8"], env=how)
    log = job.log(job_id)
    assert rc == 0, log
    results = _results(job.run_dir, 2)
    for rank, r in enumerate(results):
        assert r["rank"] == rank and r["local_rank"] == rank
        assert r["world_size"] == 2
        assert r["rank_sum"] == 1.0  # 0 + 1: the all-reduce ran across both processes
        assert r["node"] == "localhost"
        assert r["config"] == "cfg.yaml"
        # the launcher asks for CUDA (MBOOST_DEVICE unset) ahead of the user's overrides
        assert r["overrides"] == ["training.device=cuda", f"run_dir={job.run_dir}",
                                  "model.hidden=8"]
        assert r["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
        assert r["env"]["OMP_NUM_THREADS"] == "1"
        assert not r["resumed"]
    if job.env.get("PYTHON_ENV"):
        assert results[0]["env"]["VIRTUAL_ENV"] == job.env["PYTHON_ENV"]
    assert "2 process(es)/node" in log


def test_the_step_gets_the_allocations_cpus(slurm1, job):
    """Without sbatch --cpus-per-task, the one-task-per-node step must still get every CPU the
    job holds on the node (here all 2 of it, --exclusive), not Slurm's one CPU per task, and
    the ranks share them (OMP_NUM_THREADS)."""
    rc, job_id = _submit(slurm1, job, env={"NPROC_PER_NODE": "2"}, sbatch_args=["--exclusive"])
    log = job.log(job_id)
    assert rc == 0, log
    results = _results(job.run_dir, 2)
    for r in results:
        assert r["env"]["SLURM_CPUS_PER_TASK"] == "2", r["env"]
        assert r["env"]["OMP_NUM_THREADS"] == "1"  # 2 CPUs / 2 processes
    assert "CPUs=2" in results[0]["step"], results[0]["step"]
    assert "2 CPU(s)/node" in log, log


def test_extra_srun_arguments_and_network_settings_reach_the_step(slurm1, job):
    """SRUN_ARGS reach srun (the step's record carries the name given there), and network
    settings reach every rank, also where the cluster's default exports nothing to steps
    (SLURM_EXPORT_ENV=NONE); a value with commas stays whole."""
    env = {"NPROC_PER_NODE": "2", "SRUN_ARGS": "--job-name=mboost-step-probe --label",
           "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "^docker,veth",
           "NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1", "SLURM_EXPORT_ENV": "NONE"}
    rc, job_id = _submit(slurm1, job, env=env)
    log = job.log(job_id)
    assert rc == 0, log
    results = _results(job.run_dir, 2)
    assert "Name=mboost-step-probe" in results[0]["step"], results[0]["step"]
    for r in results:
        assert r["env"]["GLOO_SOCKET_IFNAME"] == "lo", r["env"]
        assert r["env"]["NCCL_SOCKET_IFNAME"] == "^docker,veth"
        assert r["env"]["NCCL_IB_HCA"] == "mlx5_0:1,mlx5_1:1"
    assert "network settings: NCCL_SOCKET_IFNAME=^docker,veth GLOO_SOCKET_IFNAME=lo" in log, log


def test_srun_arguments_that_change_the_layout_are_refused(slurm1, job):
    rc, job_id = _submit(slurm1, job, env={"SRUN_ARGS": "--ntasks=4"})
    log = job.log(job_id)
    assert rc == 2, log
    assert "error: SRUN_ARGS '--ntasks=4'" in log, log
    assert not job.run_dir.exists()


def test_trainer_failure_fails_the_job_with_one_error_line(slurm1, job):
    """Both ranks fail: the job's log has the first failing rank's line once, not one per rank
    nor torchrun's report, and the job ends with the rank's status."""
    rc, job_id = _submit(slurm1, job, ["exit_code=3"], env={"NPROC_PER_NODE": "2"})
    log = job.log(job_id)
    assert rc == 3, log
    assert "training step exited with status 3" in log, log
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "exit status 3" in errors[0], log
    assert "ChildFailedError" not in log and "Traceback" not in log, log
    assert "requeue" not in log
    assert not list(job.run_dir.glob("result-rank*.json"))


def test_missing_config_argument_is_a_usage_error(slurm1, job):
    rc, job_id = slurm1.sbatch(SBATCH, [], env=job.env, cwd=job.submit, timeout=60)
    assert rc == 2
    assert "usage:" in job.log(job_id)


def test_preemption_signal_checkpoints_requeues_and_resumes(slurm1, job):
    t0 = time.monotonic()
    rc, job_id = _submit(slurm1, job, ["wait_for_signal=45"], env={"NPROC_PER_NODE": "2"},
                         wait=False)
    assert rc == 0
    started = job.run_dir / "started-0"
    deadline = time.monotonic() + 45
    while not started.exists():
        state = slurm1.job_state(job_id)
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), (state, job.log(job_id))
        assert time.monotonic() < deadline, f"trainer did not start\n{job.log(job_id)}"
        time.sleep(0.2)

    # What Slurm does for --signal=B:USR1@N (time limit near, or pre-emption with
    # PreemptParameters=send_user_signal): SIGUSR1 to the batch shell only.
    slurm1.run(["scancel", "--batch", "--signal=USR1", str(job_id)], check=True)
    info = slurm1.wait_job(job_id, timeout=60)
    log = job.log(job_id)
    assert info["JobState"] == "COMPLETED", (info, log)
    assert info["ExitCode"] == "0:0", (info, log)
    assert info["Restarts"] == "1", (info, log)

    # first run: every rank got SIGUSR1 and took part in the checkpoint
    for rank in range(2):
        pre = json.loads((job.run_dir / f"preempted-rank{rank}.json").read_text())
        assert "SIGUSR1" in pre["signals"], pre
        assert pre["restart"] == "0"
    assert (job.run_dir / "checkpoint.json").exists()
    assert "forwarding SIGUSR1" in log and "requeueing job" in log, log

    # second run (same job id, SLURM_RESTART_COUNT=1) resumed from the checkpoint and finished
    for r in _results(job.run_dir, 2):
        assert r["resumed"] is True, r
        assert r["restart"] == "1", r
        assert r["job_id"] == str(job_id)
        assert r["world_size"] == 2
    # both runs' steps exit 0 (the launcher after a saved pre-emption too): the signal, not
    # the status, made the job requeue
    assert log.count("training step exited with status 0") == 2, log
    print(f"pre-emption round trip took {time.monotonic() - t0:.1f}s")
