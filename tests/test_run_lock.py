"""One owner per run directory (megatron_boost/train/run_lock.py): the lock in-process against
real processes as owners (a live one, a dead one), and once through the entry point: a second
launch into a run directory whose owner runs is refused in one line and deletes nothing, and
a finished run leaves no lock behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_boost.train.run_lock import LOCK_FILE, RunLock, owner_record
from tests.test_bad_input import error_messages
from tests.test_training import run_training

TIMEOUT = 60


@pytest.fixture
def live_process():
    """A process of this host that runs for the test's length (another launch, say)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait(timeout=TIMEOUT)


def _plant_lock(directory: Path, pid: int, **fields) -> dict:
    record = {**owner_record(pid), **fields}
    (directory / LOCK_FILE).write_text(json.dumps(record))
    return record


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=TIMEOUT)
    return proc.pid


@pytest.mark.fast
def test_the_lock_names_its_owner_and_goes_with_it(tmp_path):
    lock = RunLock()
    lock.acquire([tmp_path, tmp_path / "checkpoints"])  # a nested directory is covered
    record = json.loads((tmp_path / LOCK_FILE).read_text())
    assert {"host", "pid", "started"} <= set(record) and record["pid"] == lock.record["pid"]
    assert not (tmp_path / "checkpoints" / LOCK_FILE).exists()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


@pytest.mark.fast
def test_a_live_owner_on_this_host_is_refused_in_one_line(tmp_path, live_process):
    record = _plant_lock(tmp_path, live_process.pid)
    with pytest.raises(ValueError) as err:
        RunLock().acquire([tmp_path])
    message = str(err.value)
    assert "\n" not in message
    for part in (str(tmp_path), f"host {record['host']}", f"pid {live_process.pid}",
                 "logging.run_dir"):
        assert part in message, message
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == record  # left as it was


@pytest.mark.fast
def test_a_dead_owner_on_this_host_is_taken_over_saying_so(tmp_path):
    pid = _dead_pid()
    _plant_lock(tmp_path, pid)
    said, lock = [], RunLock()
    lock.acquire([tmp_path], say=said.append)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == lock.record["token"]
    assert len(said) == 1 and f"pid {pid}" in said[0] and "taking over" in said[0], said
    lock.release()


@pytest.mark.fast
def test_another_hosts_lock_is_refused_with_how_to_remove_it(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _plant_lock(tmp_path, 4242, host="node-elsewhere")
    with pytest.raises(ValueError) as err:
        RunLock().acquire([tmp_path])
    message = str(err.value)
    assert "node-elsewhere" in message and "pid 4242" in message, message
    assert f"remove {tmp_path / LOCK_FILE}" in message, message


@pytest.mark.fast
def test_a_requeued_slurm_job_takes_over_its_earlier_starts_lock(tmp_path, monkeypatch):
    """A requeue may land on another node: the same job id with another restart count is the
    job's own earlier start; the same start on another node (a second launch) is not."""
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    _plant_lock(tmp_path, 4242, host="node-elsewhere", slurm_job_id="777",
                slurm_restart_count=1)
    with pytest.raises(ValueError):
        RunLock().acquire([tmp_path])
    _plant_lock(tmp_path, 4242, host="node-elsewhere", slurm_job_id="777",
                slurm_restart_count=0)
    said, lock = [], RunLock()
    lock.acquire([tmp_path], say=said.append)
    assert "Slurm job 777" in said[0], said
    lock.release()


@pytest.mark.fast
def test_release_leaves_a_lock_another_launch_took(tmp_path, live_process):
    lock = RunLock()
    lock.acquire([tmp_path])
    other = _plant_lock(tmp_path, live_process.pid)  # e.g. judged ours gone and took over
    lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == other


def test_a_second_launch_is_refused_and_deletes_nothing(tmp_path, live_process):
    """A run whose owner still runs: the second launch ends with one line naming the owner,
    status 2, and neither the owner's save in flight (iter_N.tmp) nor its log is touched;
    once the owner is gone, the same launch takes over, trains and releases the lock."""
    run = tmp_path / "run"
    in_flight = run / "checkpoints" / "iter_0000002.tmp"
    in_flight.mkdir(parents=True)
    (in_flight / "__0_0.distcp").write_bytes(b"shard being written")
    _plant_lock(run, live_process.pid)
    args = [f"logging.run_dir={run}", "training.train_iters=3", "training.eval_interval=100"]
    proc = run_training(1, args, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(error_messages(proc.stderr.splitlines())) == 1, proc.stderr[-3000:]
    assert f"pid {live_process.pid}" in proc.stderr and "Traceback" not in proc.stderr
    assert (in_flight / "__0_0.distcp").exists() and not (run / "metrics.jsonl").exists()
    live_process.kill()
    live_process.wait(timeout=TIMEOUT)
    proc = run_training(1, args)
    assert f"taking over {LOCK_FILE}" in proc.stdout, proc.stdout[-3000:]
    assert not (run / LOCK_FILE).exists() and not in_flight.exists()
