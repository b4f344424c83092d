"""The real launcher with the real trainer, under a real (private) Slurm cluster.

scripts/slurm/pretrain.sbatch runs pretrain_lowrank.py on configs/debug.yaml (mock data, CPU,
gloo): one node with two processes, two fake nodes with one process each (the same TP=2 layout
across nodes, so the same losses), a trainer that fails on a bad config, and a pre-emption:
SIGUSR1 to the batch shell (what ``--signal=B:USR1@N`` delivers) -> checkpoint -> requeue ->
the requeued run resumes from that checkpoint and finishes. So that the signal lands mid-run
whatever the machine's speed, the test holds the trainer's ranks with SIGSTOP after the first
logged iteration, sends the signal, waits until it is pending in both ranks, and lets them go
on (SIGCONT): they act on it at the next step boundary. Skipped without Slurm or root.

The two-node test runs last, so the one-node tests share one cluster (one cluster at a time).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.slurm_cluster import launcher_env, slurm_available

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "scripts" / "slurm" / "pretrain.sbatch"
CONFIG = REPO / "configs" / "debug.yaml"

_OK, _WHY = slurm_available()
pytestmark = pytest.mark.skipif(not _OK, reason=f"no Slurm test cluster: {_WHY}")


@pytest.fixture
def job(tmp_path):
    submit = tmp_path / "submit"
    (submit / "logs").mkdir(parents=True)
    return SimpleNamespace(submit=submit, run_dir=tmp_path / "run",
                           env=launcher_env(REPO / "pretrain_lowrank.py"),
                           log=lambda jid: (submit / "logs" / f"mboost-pretrain-{jid}.out")
                           .read_text(errors="replace"))


def _submit(cluster, job, overrides=(), env=None, sbatch_args=(), wait=True, timeout=240):
    e = dict(job.env, MBOOST_DEVICE="cpu")  # the launcher asks for CUDA unless told otherwise
    e.update(env or {})
    args = [str(CONFIG), "parallel.tp=2", f"logging.run_dir={job.run_dir}",
            "training.train_iters=4", "training.eval_interval=4", *overrides]
    return cluster.sbatch(SBATCH, args, wait=wait, extra_sbatch_args=list(sbatch_args),
                          env=e, cwd=job.submit, timeout=timeout)


def _train_losses(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in records if r.get("loss") is not None}


@pytest.fixture(scope="module")
def one_node_losses(slurm_pool, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_node")
    j = SimpleNamespace(submit=tmp / "submit", run_dir=tmp / "run",
                        env=launcher_env(REPO / "pretrain_lowrank.py"))
    (j.submit / "logs").mkdir(parents=True)
    ok, why = slurm_available(1)
    if not ok:
        pytest.skip(why)
    rc, jid = _submit(slurm_pool.get(1), j, env={"NPROC_PER_NODE": "2"})
    log = (j.submit / "logs" / f"mboost-pretrain-{jid}.out").read_text(errors="replace")
    assert rc == 0, log
    return _train_losses(j.run_dir), j.run_dir


def test_one_node_two_processes_trains_and_writes_metrics(one_node_losses):
    losses, run_dir = one_node_losses
    assert sorted(losses) == [1, 2, 3, 4]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for field in ("iteration", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "tflops",
                  "mfu", "tp_comm_bytes"):
        assert field in records[0], field
    assert any("val_ppl" in r for r in records)
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").exists()


def test_a_config_error_fails_the_job_with_one_error_line(slurm_cluster_of, job):
    # Two processes: the error is one line in the log, not one per rank nor torchrun's report
    # (tests/test_slurm.py fails both ranks of a started run); usage status 2.
    rc, jid = _submit(slurm_cluster_of(1), job, ["model.hiden_size=3"],
                      env={"NPROC_PER_NODE": "2"})
    log = job.log(jid)
    assert rc == 2, log
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "unknown key 'hiden_size'" in errors[0], log
    assert "ChildFailedError" not in log and "Traceback" not in log, log
    assert "requeue" not in log


PREEMPT_ITERS = 20
LAUNCHER = "megatron_boost.cli.launch"


def _trainer_ranks(cluster) -> list[int]:
    """PIDs of the trainer ranks of the cluster's running job: the children of the launcher
    (torchrun runs in its process)."""
    def cmdline(pid):
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return ""

    def ppid(pid):
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return 0

    return [pid for pid in cluster.job_pids() if "pretrain_lowrank.py" in cmdline(pid)
            and LAUNCHER not in cmdline(pid) and LAUNCHER in cmdline(ppid(pid))]


def _proc_status(pid: int) -> dict:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def _usr1_pending_or_running(pid: int) -> bool:
    st = _proc_status(pid)
    pending = int(st.get("SigPnd", "0"), 16) | int(st.get("ShdPnd", "0"), 16)
    return bool(pending & (1 << (signal.SIGUSR1 - 1))) or not st.get("State", "T").startswith("T")


def _wait_until(cond, timeout: float, what: str, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(poll)


def test_preemption_checkpoints_requeues_and_resumes(slurm_cluster_of, job):
    cluster = slurm_cluster_of(1)
    iters = PREEMPT_ITERS
    rc, jid = _submit(cluster, job, [f"training.train_iters={iters}",
                                     "training.eval_interval=1000"],
                      env={"NPROC_PER_NODE": "2"}, wait=False)
    assert rc == 0
    metrics = job.run_dir / "metrics.jsonl"

    def logged() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    # Find the two ranks while they start, then hold them (SIGSTOP) once iteration 1 is logged
    # (looked for every 20 ms then, so that they are held within a few iterations).
    ranks: list[int] = []
    deadline = time.monotonic() + 180
    while len(ranks) != 2:
        assert cluster.job_state(jid) in ("PENDING", "RUNNING", "CONFIGURING"), job.log(jid)
        assert time.monotonic() < deadline, job.log(jid)
        ranks = _trainer_ranks(cluster)
        time.sleep(0.1)
    while logged() < 1:
        assert all(_proc_status(p) for p in ranks), f"a rank ended\n{job.log(jid)}"
        assert time.monotonic() < deadline, job.log(jid)
        time.sleep(0.02)
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    try:
        _wait_until(lambda: all(_proc_status(p).get("State", "").startswith("T") for p in ranks),
                    30, "the ranks did not stop")
        done = logged()
        # Held within iteration done + 1 (rank 0; the other rank at most one step ahead): a
        # signal pending now is acted on at iteration done + 2 at the latest, before the end.
        assert done + 2 < iters, f"training ran to iteration {done} before it was held"
        # What Slurm sends at --signal=B:USR1@N: SIGUSR1 to the batch shell only; the shell
        # forwards it to the step (srun, torchrun, the ranks).
        cluster.run(["scancel", "--batch", "--signal=USR1", str(jid)], check=True)
        _wait_until(lambda: all(_usr1_pending_or_running(p) for p in ranks), 60,
                    f"SIGUSR1 did not reach the ranks\n{job.log(jid)}")
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    info = cluster.wait_job(jid, timeout=240)
    log = job.log(jid)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, log)
    assert "pre-emption signal received, checkpoint saved at iteration" in log, log
    saved = int(log.split("checkpoint saved at iteration")[1].split()[0])
    assert 0 < saved <= done + 2, (saved, done, log)
    assert f"at iteration {saved}" in log.split("resumed from")[1].splitlines()[0], log
    losses = _train_losses(job.run_dir)
    # One trajectory: every iteration exactly once, up to the end of training.
    assert sorted(losses) == list(range(1, iters + 1))


def test_two_nodes_one_process_each_same_losses(slurm_cluster_of, job, one_node_losses):
    rc, jid = _submit(slurm_cluster_of(2), job, sbatch_args=["--nodes=2"])
    log = job.log(jid)
    assert rc == 0, log
    assert "rendezvous n1:" in log
    losses, _ = one_node_losses
    # The same TP=2 layout, now across two nodes: the same arithmetic, the same losses.
    assert _train_losses(job.run_dir) == losses
