"""Fault tolerance of the training loop, on TP=2 gloo runs (configs/debug.yaml, CPU): the runs
that are killed or hang are real torchrun launches; the runs that finish (the uninterrupted
reference, the relaunches, the non-finite run) run the entry point in the rank pool
(tests/rank_pool.py).

The faults are injected from outside the product: a run given one of their variables runs
``tests/fault_entry.py`` (the entry point's ``main`` with ``megatron_boost/testing/faults.py``'s
trainer callbacks) instead of ``pretrain_lowrank.py`` (under the launcher through its
``--entry``, which skips the launcher's up-front check of the configuration: the ranks still
check it).

* Kill and resume: one rank is SIGKILLed after a seeded random iteration; all ranks are
  SIGKILLed while the second checkpoint is being written (the save sleeps before its commit
  through ``MEGATRON_BOOST_TEST_SAVE_SLEEP``; the kill comes when its ``iter_*.tmp`` directory
  appears), with synchronous and asynchronous saves. The launcher must exit non-zero, the
  tracker must name a complete checkpoint, and the same command relaunched must finish with
  every logged loss equal, bit for bit, to an uninterrupted run's.
* Non-finite steps: ``MEGATRON_BOOST_TEST_NAN_AT`` makes one rank's loss NaN; the step is
  skipped on every rank (checkpoints before and after it hold the same weights and optimizer
  state) and logged; after ``training.max_skipped_steps`` consecutive skips the run stops
  with a message naming the iteration and saves nothing new (here: skips at 3 and 4 stop the
  run before the save due at 4).
* Hang: ``MEGATRON_BOOST_TEST_HANG_AT`` makes one rank stop responding; with
  ``parallel.timeout_minutes=0.1`` the job ends within a bounded time, naming the rank. The
  hung rank is stuck in communication (``FaultInjector.maybe_hang``, testing/faults.py), so it
  ends when the rank that found it stops, not after torchrun's 30 s SIGTERM-to-SIGKILL grace.
* Pre-emption under the README's launcher (``scripts/run_local.sh``, ``cli/launch.py``):
  SIGINT (Ctrl-C: to the launcher's whole process group, as a terminal sends it) and SIGTERM,
  sent while the checkpoint of iteration 2 is being written, stop the run at the next step
  boundary (3) with a checkpoint there and exit status 0; the same command relaunched gives
  the uninterrupted run's losses bit for bit. A rank's fault under the launcher is one line.
* Asynchronous save: the same losses as the synchronous reference, every checkpoint committed;
  every save logs the seconds it blocked training (sync vs async printed with ``-s``). The
  asynchronous run checked is the relaunch of the asynchronous kill-during-save case (one run
  serves both tests).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from tests import fault_entry
from tests.rank_pool import ENTRY as POOL_ENTRY
from tests.test_bad_input import error_messages
from tests.test_training import DEBUG, ENTRY, ROOT, _cmd, _env, losses, metrics, run_training

TIMEOUT = 300
ITERS = 8
COMMON = ["parallel.tp=2", f"training.train_iters={ITERS}", "checkpoint.save_interval=2",
          "training.eval_interval=1000", "logging.log_interval=1"]
TRACKER = "latest_checkpointed_iteration.txt"
SEED = 20261203


class Launch:
    """One torchrun job; its output goes to a file (megatron's checkpoint helper processes of
    a killed rank outlive it and would hold a pipe open). Leftover processes of the ranks'
    sessions (torchrun starts each rank in its own) are killed when the job ends; the test's
    own session never is."""

    def __init__(self, run_dir: Path, extra=(), env_extra=None, launcher: bool = False):
        """``launcher``: the README's launch command (scripts/run_local.sh), in a session of
        its own, as a terminal's foreground job is (a signal to its group reaches the launcher
        only; each rank leads its own session); else bare torchrun."""
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.log = run_dir.parent / f"{run_dir.name}-{time.time_ns()}.log"
        env = dict(_env(), **(env_extra or {}))
        overrides = COMMON + [f"logging.run_dir={run_dir}", *extra]
        # a fault is injected by the harness's entry (tests/fault_entry.py)
        self.entry = fault_entry.PATH if env_extra else ENTRY
        with_entry = ["--entry", self.entry] if env_extra else []
        cmd = [str(ROOT / "scripts" / "run_local.sh"), "2", str(DEBUG), *with_entry,
               *overrides] if launcher else _cmd(2, overrides, entry=self.entry)
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=launcher)
        self.sessions = set()

    def workers(self) -> list:
        """torchrun's rank processes: its children running the trainer, each the leader of
        its own session. A child torchrun has forked but that has not yet called setsid is
        not one: it still has torchrun's command line (which names the trainer) and torchrun's
        session, which is this test's, and recording that session would make the end of the
        job kill the test runner and everything it runs in."""
        import psutil

        def is_rank(child) -> bool:
            try:
                return os.getsid(child.pid) == child.pid \
                    and os.path.basename(self.entry) in " ".join(child.cmdline())
            except (psutil.NoSuchProcess, ProcessLookupError):  # exited meanwhile
                return False

        found = [c for c in psutil.Process(self.proc.pid).children() if is_rank(c)]
        self.sessions |= {w.pid for w in found}  # a session leader's session id is its pid
        return found

    def _kill_leftovers(self) -> None:
        import psutil

        sessions = self.sessions - {os.getsid(0)}
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) in sessions:
                    p.kill()
            except (ProcessLookupError, psutil.Error):
                pass

    def finish(self, timeout: float = TIMEOUT) -> str:
        """Wait for the launcher; its output."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.workers()
            self.proc.kill()
            raise AssertionError(f"run did not end within {timeout}s:\n"
                                 f"{self.log.read_text()[-4000:]}")
        finally:
            self._kill_leftovers()
        return self.log.read_text()


def _run(run_dir: Path, extra=(), env_extra=None) -> str:
    """A run that is meant to finish (the reference, a relaunch, the non-finite run): the
    entry point's ``main(argv)`` on two ranks of the rank pool (tests/rank_pool.py), since
    what it computes is the subject; the runs that are killed or hang are real launches.
    Its console output (both streams)."""
    proc = run_training(2, [*COMMON, f"logging.run_dir={run_dir}", *extra], env_extra=env_extra,
                        timeout=TIMEOUT, target=fault_entry.TARGET if env_extra else POOL_ENTRY)
    return proc.stdout + proc.stderr


def _wait_for(predicate, job: Launch, what: str) -> None:
    deadline = time.time() + TIMEOUT
    while not predicate():
        if job.proc.poll() is not None:
            raise AssertionError(f"run ended before {what}:\n{job.log.read_text()[-4000:]}")
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _temp_dir_exists(run_dir: Path) -> bool:
    return any((run_dir / "checkpoints").glob("iter_*.tmp"))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted run (synchronous saves): (losses by iteration, console output)."""
    run_dir = tmp_path_factory.mktemp("reference")
    out = _run(run_dir)
    ref = losses(run_dir)
    assert sorted(ref) == list(range(1, ITERS + 1))
    return ref, out


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run[0]


def _kill_point(kind: str, rng: random.Random, run_dir: Path):
    """(predicate that fires at the kill point, environment for the run)."""
    if kind == "after_iteration":
        after = rng.randint(1, ITERS - 2)
        return (lambda: _logged(run_dir) >= after), {}, f"after iteration {after}"
    # the second save (iteration 4): a complete checkpoint (2) is already tracked
    return (lambda: _temp_dir_exists(run_dir) and (run_dir / "checkpoints" / TRACKER).exists()), \
        {"MEGATRON_BOOST_TEST_SAVE_SLEEP": "3"}, "during the second checkpoint write"


@dataclass
class KilledRun:
    """A launch killed at a kill point, then the same command relaunched to the end."""

    run_dir: Path
    killed_returncode: int
    tracker_after_kill: Optional[str]  # what the tracker named after the kill (None: no file)
    named_complete: bool  # the checkpoint it named has its manifest and metadata
    killed_out: str
    relaunch_out: str


def _kill_and_relaunch(run_dir: Path, kind: str, async_save: bool) -> KilledRun:
    rng = random.Random(f"{SEED}-{kind}-{async_save}")
    extra = [f"checkpoint.async_save={str(async_save).lower()}"]
    fires, env, where = _kill_point(kind, rng, run_dir)
    job = Launch(run_dir, extra, env)
    _wait_for(fires, job, where)
    # During a save every rank dies at once (a node failure: no rank can finish the commit);
    # otherwise one random rank.
    victims = job.workers() if kind == "during_save" else [rng.choice(job.workers())]
    for victim in victims:
        victim.send_signal(signal.SIGKILL)
    killed_out = job.finish()
    tracker = run_dir / "checkpoints" / TRACKER
    named, complete = (tracker.read_text().strip() if tracker.exists() else None), False
    if named is not None:
        ckpt = run_dir / "checkpoints" / f"iter_{int(named):07d}"
        complete = (ckpt / "manifest.json").is_file() and (ckpt / "metadata.json").is_file()
    print(f"killed pids {[v.pid for v in victims]} {where} (async_save={async_save}); tracker: "
          f"{named or 'none'}")
    return KilledRun(run_dir, job.proc.returncode, named, complete, killed_out,
                     _run(run_dir, extra))


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """``killed_run(kind, async_save)``: the :class:`KilledRun` of that case, made once per
    module (the asynchronous save test reads the relaunch of the asynchronous one)."""
    made = {}

    def get(kind: str, async_save: bool) -> KilledRun:
        if (kind, async_save) not in made:
            run_dir = tmp_path_factory.mktemp(f"killed-{kind}-{async_save}") / "run"
            made[kind, async_save] = _kill_and_relaunch(run_dir, kind, async_save)
        return made[kind, async_save]
    return get


@pytest.mark.compat
@pytest.mark.parametrize("kind,async_save", [("after_iteration", False),
                                             ("during_save", False), ("during_save", True)])
def test_killed_rank_relaunch_reproduces_losses(reference, killed_run, kind, async_save):
    run = killed_run(kind, async_save)
    assert run.killed_returncode != 0, run.killed_out[-3000:]
    if kind == "during_save":  # still the previous, complete checkpoint
        assert run.tracker_after_kill == "2"
    if run.tracker_after_kill is not None:  # whatever it names is complete
        assert run.named_complete, run.tracker_after_kill
    assert losses(run.run_dir) == reference


def _model_tensors(ckpt_dir: Path, tmp_path: Path) -> dict:
    """Every tensor of a checkpoint (weights and optimizer state) as a flat dict."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{ckpt_dir.name}.pt"
    dcp_to_torch_save(str(ckpt_dir), str(out))
    flat = torch.load(out, weights_only=False)
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def test_nonfinite_step_is_skipped_and_logged(tmp_path):
    import torch

    run_dir = tmp_path / "run"
    # iterations 1-4 are the ones checked: the skip at 3 between the saves at 2 and 4
    out = _run(run_dir, ["checkpoint.save_interval=1", "training.train_iters=4"],
               {"MEGATRON_BOOST_TEST_NAN_AT": "3:1"})
    recs = {r["iteration"]: r for r in metrics(run_dir)}
    assert recs[3]["skipped_steps"] == 1 and recs[2]["skipped_steps"] == 0, recs[3]
    assert "skipped" in out and "iteration 3" in out, out[-3000:]
    before = _model_tensors(run_dir / "checkpoints" / "iter_0000002", tmp_path)
    after = _model_tensors(run_dir / "checkpoints" / "iter_0000003", tmp_path)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    nxt = _model_tensors(run_dir / "checkpoints" / "iter_0000004", tmp_path)
    assert any(not torch.equal(after[k], nxt[k]) for k in after)  # training went on


def _bare_launch(launcher_code: str) -> Launch:
    """A Launch of no run: only its launcher process (``python -c launcher_code``) and the
    sessions it records, for the tests of the rank search."""
    job = Launch.__new__(Launch)
    job.sessions, job.entry = set(), ENTRY
    job.proc = subprocess.Popen([sys.executable, "-c", launcher_code])
    return job


def test_finding_the_ranks_skips_a_child_that_has_exited():
    """A launcher's child that has exited but is not reaped yet (a zombie, whose command line
    cannot be read) is not a rank, and does not break the search."""
    # The child leads its own session, as a rank does, so the search reads its command line.
    # The launcher keeps its Popen: a dropped one is polled (reaped) by its finaliser whenever
    # the child has already exited, which on a loaded machine left no zombie to find.
    job = _bare_launch("import subprocess, time; "
                       "child = subprocess.Popen(['true'], start_new_session=True); "
                       "time.sleep(60)")
    try:
        import psutil

        deadline = time.monotonic() + 30
        while not any(c.status() == psutil.STATUS_ZOMBIE
                      for c in psutil.Process(job.proc.pid).children()):
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.05)
        assert job.workers() == []
    finally:
        job.proc.kill()
        job.proc.wait(timeout=30)


def test_finding_the_ranks_skips_a_child_still_in_the_launchers_session():
    """torchrun forks each rank, and the child then calls setsid: in between, it has torchrun's
    command line (which names the trainer) and torchrun's session, which is this test's. Only
    a child that leads its own session is a rank, so this test's session is never recorded
    (the job's end kills the recorded sessions)."""
    import psutil

    trainer_like = "[sys.executable, '-c', 'import time; time.sleep(60)', 'pretrain_lowrank.py']"
    job = _bare_launch("import subprocess, sys, time; "
                       f"[subprocess.Popen({trainer_like}, start_new_session=new) "
                       "for new in (False, True)]; time.sleep(60)")
    try:
        deadline = time.monotonic() + 30
        while len([c for c in psutil.Process(job.proc.pid).children()
                   if "pretrain_lowrank.py" in c.cmdline()]) < 2:
            assert time.monotonic() < deadline, "the launcher's children did not start"
            time.sleep(0.05)
        found = job.workers()
        assert len(found) == 1 and os.getsid(found[0].pid) == found[0].pid, found
        assert job.sessions == {found[0].pid}
        assert os.getsid(0) not in job.sessions
    finally:
        for child in psutil.Process(job.proc.pid).children():
            child.kill()
        job.proc.kill()
        job.proc.wait(timeout=30)


def test_the_end_of_a_job_spares_the_tests_own_session():
    """Were the test's own session recorded, killing the job's leftovers still spares it: run
    in a process that leads a session of its own, which the end of a job must not kill."""
    script = ("import os; from tests.test_fault_tolerance import Launch; "
              "job = Launch.__new__(Launch); job.sessions = {os.getsid(0)}; "
              "job._kill_leftovers(); print('still running')")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT,
                          env=dict(_env(), PYTHONPATH=str(ROOT)), start_new_session=True,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "still running" in proc.stdout, (proc.returncode,
                                                                     proc.stderr[-2000:])


def test_consecutive_nonfinite_steps_stop_the_run(tmp_path):
    """Under the launcher: every rank decides alike, and the launcher prints the first failing
    rank's line once, with the fault's exit status 1 (no line per rank, no torchrun report)."""
    run_dir = tmp_path / "run"
    job = Launch(run_dir, ["training.max_skipped_steps=2"],
                 {"MEGATRON_BOOST_TEST_NAN_AT": "3-100:0"}, launcher=True)
    out = job.finish()
    assert job.proc.returncode == 1, out[-3000:]
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: "), out[-3000:]
    assert "iteration 4" in errors[0] and "max_skipped_steps" in errors[0], out[-3000:]
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*"))
    assert saved == ["iter_0000002"], saved
    assert (run_dir / "checkpoints" / TRACKER).read_text().strip() == "2"


def test_unresponsive_rank_ends_the_job_in_bounded_time(tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.time()
    job = Launch(run_dir, ["parallel.timeout_minutes=0.1"],
                 {"MEGATRON_BOOST_TEST_HANG_AT": "3:1"})
    # record the ranks' sessions: the hung rank is killed with the job's leftovers
    _wait_for(lambda: len(job.workers()) == 2, job, "two ranks")
    out = job.finish(timeout=150)
    elapsed = time.time() - t0
    assert job.proc.returncode != 0, out[-3000:]
    # rank 0's line (a rank's own error is prefixed "error: rank K:"; the hung rank, whose
    # wait fails once rank 0 has stopped, may print one too)
    lines = [l for l in out.splitlines() if l.startswith("error: rank 1 did not respond")]
    assert lines and "timeout_minutes" in lines[0], out[-3000:]
    print(f"hung rank detected after {elapsed:.1f}s of wall time (timeout 6 s)")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_to_the_launcher_saves_exits_0_and_resumes_exactly(reference, tmp_path, signum):
    run_dir = tmp_path / "run"
    # the signal comes while iteration 2's checkpoint is being written (the save sleeps 3 s):
    # the ranks agree on it in step 3's all-reduce and stop at that boundary, deterministically
    job = Launch(run_dir, env_extra={"MEGATRON_BOOST_TEST_SAVE_SLEEP": "3"}, launcher=True)
    _wait_for(lambda: _temp_dir_exists(run_dir) and len(job.workers()) == 2, job,
              "the first checkpoint write")
    os.killpg(job.proc.pid, signum)  # Ctrl-C: the terminal signals the foreground group
    out = job.finish()
    assert job.proc.returncode == 0, out[-3000:]  # the status the README states
    name = signal.Signals(signum).name
    assert f"checkpoint saved at iteration 3 ({name}; exiting with status 0)" in out, out[-3000:]
    assert "Traceback" not in out and "error" not in out.lower(), out[-3000:]
    assert (run_dir / "checkpoints" / TRACKER).read_text().strip() == "3"
    assert sorted(losses(run_dir)) == [1, 2, 3]
    _run(run_dir)  # the same command again: resumes at 3 and runs to the end
    assert losses(run_dir) == reference


def test_a_second_ctrl_c_stops_at_once_with_one_line(tmp_path):
    """Ctrl-C twice: the launcher stops the ranks at once (the first Ctrl-C's save is cut),
    prints one line and exits 130; the last complete checkpoint stays in force."""
    run_dir = tmp_path / "run"
    job = Launch(run_dir, env_extra={"MEGATRON_BOOST_TEST_SAVE_SLEEP": "30"}, launcher=True)
    _wait_for(lambda: _temp_dir_exists(run_dir) and len(job.workers()) == 2, job,
              "the first checkpoint write")
    os.killpg(job.proc.pid, signal.SIGINT)
    time.sleep(0.5)
    os.killpg(job.proc.pid, signal.SIGINT)
    out = job.finish(timeout=60)
    assert job.proc.returncode == 130, out[-3000:]
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert errors == ["error: interrupted again: stopped at once without saving; the same "
                      "command resumes from the last complete checkpoint"], out[-3000:]
    # not even the save in progress finished (it sleeps 30 s before its commit)
    assert not (run_dir / "checkpoints" / TRACKER).exists()


def _stalls(out: str) -> list:
    return [float(line.split("training stalled ")[1].split("s")[0])
            for line in out.splitlines() if "training stalled " in line]


@pytest.mark.compat
def test_async_save_gives_the_same_run_and_logs_each_stall(reference_run, killed_run):
    """An asynchronous-save run equals the synchronous reference bit for bit (the save runs
    beside training and must not disturb it), commits every checkpoint (tracker on the last,
    each complete), and both runs log one stall per save. The asynchronous run is the relaunch
    of the asynchronous kill-during-save case: it resumes from an asynchronously saved
    checkpoint (2), and its saves at 4 and 6 run beside iterations 5-8. The stall seconds are
    printed, not compared: at this model size both are dominated by fixed costs (process
    start-up of the first save, fsync), so their order is noise."""
    reference, sync_out = reference_run
    run = killed_run("during_save", True)
    assert losses(run.run_dir) == reference
    saves = list(range(2, ITERS + 1, 2))  # checkpoint.save_interval=2
    ckpts = run.run_dir / "checkpoints"
    assert (ckpts / TRACKER).read_text().strip() == str(saves[-1])
    for it in saves:
        named = ckpts / f"iter_{it:07d}"
        assert (named / "manifest.json").is_file() and (named / "metadata.json").is_file(), it
    resumed = int(run.tracker_after_kill or 0)  # the relaunch saves what comes after it
    stalls = {"sync_stall_s": (_stalls(sync_out), saves),
              "async_stall_s": (_stalls(run.relaunch_out), [it for it in saves if it > resumed])}
    for kind, (values, saved) in stalls.items():
        assert len(values) == len(saved), (kind, values, saved)
        assert all(v >= 0 for v in values), (kind, values)
    print(json.dumps({kind: values for kind, (values, _) in stalls.items()}))
