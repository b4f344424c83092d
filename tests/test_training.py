"""End-to-end tests of the training loop (pretrain_lowrank.py / megatron_boost/train/trainer.py).

Every run is the entry point's ``main(argv)`` on configs/debug.yaml with mock data, fp32 on CPU,
one thread per rank, in rank processes that stay up between runs (tests/rank_pool.py: 2 gloo
ranks with torchrun's environment, or one process without it); the launch itself is tested
where it is the subject, here by (e), a real torchrun. Runs are shared between assertions
through module-scoped fixtures:

* ``base``: TP=2, distributed optimizer ON, 6 iterations, checkpoints at 3 and 6: (a) and the
  reference trajectory of (b) and (c).
* (b) a second TP=2 run loads the iteration-3 checkpoint and must reproduce iterations 4-6
  bit for bit. With megatron's shared-``step`` defect unhandled, the Adam bias correction after
  the resume is wrong and iteration 5 differs (checked by hand when this test was written).
* (c) the same checkpoint resumed at TP=1 (one process) and at PP=2 (two processes).
* (d) configuration errors: in tests/test_bad_input.py (unknown key, malformed override,
  missing data and some seventy more).
* (e) SIGUSR1 to one rank: a complete checkpoint, exit 0, and a rerun resumes from it (naive
  mode, so that its checkpoints are exercised as well).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_boost.config.run import load_run_config
from tests.rank_pool import ENTRY as POOL_ENTRY
from tests.rank_pool import pool

ROOT = Path(__file__).resolve().parents[1]
ENTRY = str(ROOT / "pretrain_lowrank.py")
DEBUG = str(ROOT / "configs" / "debug.yaml")
FIELDS = ("iteration", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu",
          "tp_comm_bytes")
TIMEOUT = 240


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("MBOOST_TRACEBACK", None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _cmd(nproc: int, overrides, config: str = DEBUG, entry: str = ENTRY):
    """The launch of ``entry`` (the trainer script; tests/fault_entry.py for faults)."""
    if nproc == 1:
        launch = [sys.executable, entry]
    else:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                  f"--nproc_per_node={nproc}", entry]
    return launch + ["--config", config, *overrides]


def run_training(nproc: int, overrides, check: bool = True, config: str = DEBUG,
                 env_extra=None, timeout: float = TIMEOUT,
                 target: str = POOL_ENTRY) -> subprocess.CompletedProcess:
    """``pretrain_lowrank.py --config <config> <overrides>`` on ``nproc`` ranks of the rank pool
    (tests/rank_pool.py), with the environment a launch of these tests gets (plus
    ``env_extra``). ``target``: the ``main`` the ranks run (tests/fault_entry.py's for a
    fault-injection variable in ``env_extra``)."""
    proc = pool().run(nproc, ["--config", config, *overrides],
                      env=dict(_env(), **(env_extra or {})), cwd=str(ROOT), timeout=timeout,
                      target=target)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed (exit {proc.returncode}):\n"
                             f"--- stdout ---\n{proc.stdout[-4000:]}\n"
                             f"--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def metrics(run_dir) -> list:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(run_dir) -> dict:
    return {r["iteration"]: r["loss"] for r in metrics(run_dir) if r.get("loss") is not None}


def common_state(ckpt_dir) -> dict:
    from megatron_boost.train.checkpoint_guard import read_common_state

    return read_common_state(ckpt_dir)  # common.pt up to megatron-core 0.16, in the shards after


BASE = ["parallel.tp=2", "parallel.use_distributed_optimizer=true", "checkpoint.save_interval=3",
        "training.train_iters=6", "training.eval_interval=3", "logging.log_interval=1"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("base")
    proc = run_training(2, BASE + [f"logging.run_dir={run_dir}"])
    return run_dir, proc


# ------------------------------------------------------------------------------------------
# (a) end to end
# ------------------------------------------------------------------------------------------


def test_end_to_end_metrics_and_checkpoint(base):
    run_dir, proc = base
    recs = metrics(run_dir)
    assert [r["iteration"] for r in recs] == [1, 2, 3, 4, 5, 6]
    for r in recs:
        for key in FIELDS:
            assert key in r, (key, r)
        assert math.isfinite(r["loss"]) and r["loss"] > 0
        assert r["tokens"] == r["iteration"] * 4 * 32  # global batch 4 × seq 32
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0
        assert r["mfu"] is None  # CPU: no peak known
        assert r["tp_comm_bytes"] > 0  # TP=2: the bottleneck all-reduces were recorded
        assert r["grad_norm"] > 0
    # elapsed and ETA: in every record and console line, and in the summary; none left at the end
    assert all(a["elapsed_s"] < b["elapsed_s"] for a, b in zip(recs, recs[1:]))
    assert all(r["eta_s"] > 0 for r in recs[:-1]) and recs[-1]["eta_s"] == 0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("iter ")]
    assert len(lines) == 6 and all(" | elapsed " in line and " | ETA " in line for line in lines)
    assert lines[-1].endswith(" | ETA 0s"), lines[-1]
    assert any(line.startswith("done: ") and "training loop " in line
               for line in proc.stdout.splitlines()), proc.stdout[-2000:]
    # the phases before the first iteration: one line each, in order, with the time so far
    out = proc.stdout.splitlines()
    first_iter = next(i for i, line in enumerate(out) if line.startswith("iter "))
    setup = [line.split(" ", 2) for line in out[:first_iter] if line.startswith("setup ")]
    assert [what for _, _, what in setup] == [
        "building the model and the optimizer", "building the datasets",
        "first training step (iteration 1: the slowest)"], out[:first_iter]
    seconds = [float(at.rstrip("s:")) for _, at, _ in setup]
    assert seconds == sorted(seconds)
    evals = [r for r in recs if "val_loss" in r]
    assert [r["iteration"] for r in evals] == [3, 6]
    for r in evals:
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]))
    # warmup 2 then cosine to min_lr: lr peaks at iteration 2 and ends at min_lr
    lrs = [r["lr"] for r in recs]
    assert lrs[1] == pytest.approx(3e-3) and lrs[-1] == pytest.approx(3e-4)
    assert lrs[0] == pytest.approx(1.5e-3)
    assert recs[-1]["loss"] < recs[0]["loss"]

    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    for it in (3, 6):
        d = ckpts / f"iter_{it:07d}"
        assert (d / "metadata.json").is_file()
        state = common_state(d)
        assert state["iteration"] == it and state["consumed_samples"] == 4 * it
        assert state["layout"]["tp"] == 2 and state["use_distributed_optimizer"] is True
        assert state["run_config"]["parallel"]["tp"] == 2
    # the console line carries the loss (rank 0 prints it) and the final validation
    assert "iter      6/6" in proc.stdout and "val_ppl" in proc.stdout
    # checkpoints and logs follow the user's umask (what open() gives), as exports do
    umask = os.umask(0o022)
    os.umask(umask)
    assert {oct(p.stat().st_mode & 0o777) for p in run_dir.rglob("*") if p.is_file()} == {
        oct(0o666 & ~umask)}
    # the run as it ran (config.resolved.resolved_config_yaml), loadable as a run file
    saved = load_run_config(str(run_dir / "config.yaml"))
    assert saved.training.device == "cpu" and saved.training.precision == "fp32"
    assert saved.model.attention_backend != "auto" and saved.parallel.tp == 2


# ------------------------------------------------------------------------------------------
# (b) exact resume with the distributed optimizer
# ------------------------------------------------------------------------------------------


@pytest.mark.compat
def test_resume_reproduces_uninterrupted_run_exactly(base, tmp_path):
    run_dir, _ = base
    ckpt = run_dir / "checkpoints" / "iter_0000003"
    proc = run_training(2, BASE + [f"logging.run_dir={tmp_path}", f"checkpoint.load={ckpt}"])
    assert "resumed from" in proc.stdout and "at iteration 3" in proc.stdout
    # the done line counts this launch's iterations and tokens, the run's totals apart
    done = [line for line in proc.stdout.splitlines() if line.startswith("done: ")]
    assert len(done) == 1 and done[0].startswith(
        f"done: 3 iterations this launch (3 -> 6), {3 * 4 * 32:,} tokens in "), done
    assert f"; run total 6 iterations, {6 * 4 * 32:,} tokens" in done[0], done
    ref, got = losses(run_dir), losses(tmp_path)
    assert sorted(got) == [4, 5, 6]
    for it in (4, 5, 6):
        assert got[it] == ref[it], (it, got[it], ref[it])  # fp32 CPU: bit-identical
    ref_recs = {r["iteration"]: r for r in metrics(run_dir)}
    for r in metrics(tmp_path):
        assert r["lr"] == ref_recs[r["iteration"]]["lr"]
        assert r["grad_norm"] == ref_recs[r["iteration"]]["grad_norm"]


def _lr_curve(iters: int, *overrides) -> list:
    """The learning rate of iterations 1..iters as train/build.build_scheduler gives it for
    configs/debug.yaml (warmup 2, lr 3e-3, min_lr 3e-4) with ``overrides``."""
    import torch

    from megatron_boost.config.resolved import resolve_run
    from megatron_boost.train.build import build_scheduler

    cfg = load_run_config(DEBUG, [f"training.train_iters={iters}", *overrides])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    sched = build_scheduler(opt, resolve_run(cfg, "cpu", vocab_size=256))
    curve = []
    for _ in range(iters):
        sched.step(1)  # iteration k runs with the scheduler at step k (train/trainer.py)
        curve.append(opt.param_groups[0]["lr"])
    return curve


@pytest.mark.fast
@pytest.mark.compat  # megatron's OptimizerParamScheduler on both tiers
def test_extending_stretches_the_decay_unless_it_is_fixed():
    six = _lr_curve(6)
    assert six[-1] == pytest.approx(3e-4)
    # the default decays over the training length: extended to 9, the LR at 7 is back above
    # min_lr (what README §4 and docs/fault-tolerance.md say)
    assert _lr_curve(9)[6] > 2 * 3e-4
    # a fixed lr_decay_iters keeps the first run's curve, then min_lr
    assert _lr_curve(9, "optimizer.lr_decay_iters=6") == six + [pytest.approx(3e-4)] * 3


@pytest.mark.fast
@pytest.mark.compat  # megatron's OptimizerParamScheduler on both tiers
def test_wsd_holds_the_peak_until_its_final_decay():
    wsd = ("optimizer.lr_decay_style=wsd", "optimizer.lr_wsd_decay_iters=2")
    six, nine = _lr_curve(6, *wsd), _lr_curve(9, *wsd)
    assert six[:2] == nine[:2] == [pytest.approx(1.5e-3), pytest.approx(3e-3)]  # warmup
    assert six[2:4] == nine[2:4] == [pytest.approx(3e-3)] * 2  # stable
    assert nine[4:7] == [pytest.approx(3e-3)] * 3  # still stable where the 6-step run decays
    assert six[-1] == nine[-1] == pytest.approx(3e-4)  # the decay ends each run at min_lr
    assert nine[7] == pytest.approx((3e-3 + 3e-4) / 2)  # linear, halfway


def test_extended_run_with_fixed_decay_keeps_its_lr_curve(base, tmp_path):
    """The 6-iteration base run resumed at its end with train_iters=9 and lr_decay_iters=6:
    the schedule stays at min_lr instead of rising again."""
    run_dir, _ = base
    proc = run_training(2, BASE + [f"logging.run_dir={tmp_path}", "training.train_iters=9",
                                   "optimizer.lr_decay_iters=6",
                                   f"checkpoint.load={run_dir / 'checkpoints'}"])
    assert "at iteration 6" in proc.stdout
    recs = metrics(tmp_path)
    assert [r["iteration"] for r in recs] == [7, 8, 9]
    assert [r["lr"] for r in recs] == [pytest.approx(3e-4)] * 3


@pytest.mark.compat
def test_exit_interval_and_time_limit_stop_cleanly_and_resume_exactly(base, tmp_path):
    """A launch stopped by training.exit_interval at 2, its relaunch stopped by
    training.exit_duration_minutes after one step (3), and a last relaunch to the budget (6):
    together they must equal the uninterrupted run bit for bit (losses, lr, grad norms), since
    neither stop touches the learning-rate schedule. Each stop saves, exits 0 and says why."""
    run_dir, _ = base
    args = BASE + [f"logging.run_dir={tmp_path}"]
    tracker = tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt"
    first = run_training(2, args + ["training.exit_interval=2"])
    assert ("exit interval reached, checkpoint saved at iteration 2 "
            "(training.exit_interval=2; exiting with status 0)") in first.stdout, first.stdout
    assert tracker.read_text().strip() == "2"
    # any step outlasts a limit of 60 µs: the relaunch stops after its first step
    second = run_training(2, args + ["training.exit_duration_minutes=0.000001"])
    assert "at iteration 2" in second.stdout
    assert "time limit reached, checkpoint saved at iteration 3" in second.stdout, second.stdout
    assert tracker.read_text().strip() == "3"
    run_training(2, args)
    ref = {r["iteration"]: r for r in metrics(run_dir)}
    got = {r["iteration"]: r for r in metrics(tmp_path)}
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for it, r in got.items():  # fp32 CPU: bit-identical
        for key in ("loss", "lr", "grad_norm"):
            assert r[key] == ref[it][key], (it, key, r[key], ref[it][key])


def _agree_with_one_late_rank(rank, world):
    import torch

    from megatron_boost.train.resilience import agree_on_step

    agreed = agree_on_step([torch.tensor(1.0)], [], False, True, torch.device("cpu"),
                           time_up=rank == world - 1)
    return agreed.time_up, agreed.preempt, agreed.loss


@pytest.mark.compat
@pytest.mark.fast
def test_time_limit_on_one_rank_stops_every_rank():
    """The time limit is read from each rank's own clock; the step's all-reduce must make one
    rank past it stop every rank at the same step boundary (else the others would wait for it
    in the next step's collectives)."""
    from tests.rank_pool import distributed

    assert distributed(_agree_with_one_late_rank, 2) == [(True, False, 1.0)] * 2


def test_full_rank_resumes_across_sequence_parallel_on_and_off(tmp_path):
    """Sequence parallelism changes no parameter and no checkpoint key (the norms stay
    replicated over TP): a plain-TP checkpoint resumes with it on, and its checkpoint resumes
    with it off, each continuing the plain-TP run. To fp32 rounding, not bitwise: sequence
    parallelism sums the norms' gradients and the block outputs in another order."""
    common = ["parallel.mode=full", "parallel.tp=2", "training.train_iters=4",
              "training.eval_interval=100", "logging.log_interval=1"]
    plain, on, off = tmp_path / "plain", tmp_path / "on", tmp_path / "off"
    first = run_training(2, common + ["parallel.sequence_parallel=false",
                                      "checkpoint.save_interval=2", f"logging.run_dir={plain}"])
    assert "sequence_parallel=off (parallel.sequence_parallel=false" in first.stdout
    second = run_training(2, common + ["checkpoint.save_interval=1", f"logging.run_dir={on}",
                                       f"checkpoint.load={plain / 'checkpoints/iter_0000002'}"])
    assert "sequence_parallel=on (full mode at tp > 1" in second.stdout
    run_training(2, common + ["parallel.sequence_parallel=false", f"logging.run_dir={off}",
                              f"checkpoint.load={on / 'checkpoints/iter_0000003'}"])
    ref = losses(plain)
    assert sorted(losses(on)) == [3, 4] and sorted(losses(off)) == [4]
    for got in (losses(on), losses(off)):
        for it, loss in got.items():
            assert loss == pytest.approx(ref[it], rel=1e-5), (it, loss, ref[it])


# ------------------------------------------------------------------------------------------
# (c) resharding: TP=2 checkpoint -> TP=1, PP=2
# ------------------------------------------------------------------------------------------

RESHARD = ["parallel.use_distributed_optimizer=true", "training.train_iters=5",
           "optimizer.lr_decay_iters=6", "training.eval_interval=100", "logging.log_interval=1",
           "checkpoint.save_interval=100"]


@pytest.mark.parametrize("nproc,layout", [(1, ["parallel.tp=1"]),
                                          (2, ["parallel.tp=1", "parallel.pp=2"])],
                         ids=["tp1", "pp2"])
def test_checkpoint_reshards_to_other_layouts(base, tmp_path, nproc, layout):
    run_dir, _ = base
    ckpt = run_dir / "checkpoints" / "iter_0000003"
    # train_iters=5 with lr_decay_iters=6: the same schedule as the 6-iteration base run
    proc = run_training(nproc, RESHARD + layout + [f"logging.run_dir={tmp_path}",
                                                    f"checkpoint.load={ckpt}"])
    assert "saved layout tp=2 pp=1" in proc.stdout
    ref, got = losses(run_dir), losses(tmp_path)
    assert sorted(got) == [4, 5]
    # iteration 4: weights resharded; iteration 5: the optimizer state too
    for it in (4, 5):
        assert got[it] == pytest.approx(ref[it], rel=1e-5), (it, got[it], ref[it])


# ------------------------------------------------------------------------------------------
# (d) configuration errors: the table of tests/test_bad_input.py (one line, status 2, nothing
# written), which also uses this tokenizer
# ------------------------------------------------------------------------------------------


def _sentencepiece_model(tmp_path) -> str:
    import sentencepiece as spm

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"to be or not to be, line {i}: that is the question" for i in
                              range(200)))
    prefix = tmp_path / "spm"
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(prefix), vocab_size=300,
                                   byte_fallback=True, model_type="bpe", minloglevel=2,
                                   hard_vocab_limit=False, bos_id=1, eos_id=2, unk_id=0,
                                   pad_id=3)
    return str(prefix) + ".model"


# ------------------------------------------------------------------------------------------
# (e) pre-emption
# ------------------------------------------------------------------------------------------


def test_sigusr1_saves_checkpoint_exits_cleanly_and_resumes(tmp_path):
    import psutil

    run_dir = tmp_path / "run"
    # naive mode here (the other tests use boost): its checkpoints must save and resume too
    common = ["parallel.tp=2", "parallel.mode=naive", f"logging.run_dir={run_dir}",
              "logging.log_interval=1",
              "training.eval_interval=1000000", "parallel.use_distributed_optimizer=true"]
    p = subprocess.Popen(_cmd(2, common + ["training.train_iters=100000"]), cwd=ROOT,
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + TIMEOUT
        path = run_dir / "metrics.jsonl"
        while time.time() < deadline:
            if path.exists() and len(path.read_text().splitlines()) >= 2:
                break
            if p.poll() is not None:
                raise AssertionError(f"run ended early:\n{p.stdout.read()}\n{p.stderr.read()}")
            time.sleep(0.2)
        workers = [c for c in psutil.Process(p.pid).children(recursive=True)
                   if ENTRY in " ".join(c.cmdline())]
        assert len(workers) == 2, workers
        # Only one rank gets the signal: the ranks must still agree to stop together.
        os.kill(workers[-1].pid, signal.SIGUSR1)
        out, err = p.communicate(timeout=TIMEOUT)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, (out[-3000:], err[-3000:])
    assert "pre-emption signal received" in out, out[-3000:]
    tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    saved = int(tracker.read_text())
    assert f"checkpoint saved at iteration {saved}" in out
    ckpt = run_dir / "checkpoints" / f"iter_{saved:07d}"
    assert (ckpt / "metadata.json").is_file()
    assert common_state(ckpt)["iteration"] == saved
    assert max(losses(run_dir)) == saved

    # the rerun (same run directory, default checkpoint.load) resumes from it
    proc = run_training(2, common + [f"training.train_iters={saved + 2}"])
    assert f"at iteration {saved}" in proc.stdout, proc.stdout[-3000:]
    its = [r["iteration"] for r in metrics(run_dir)]
    assert its == list(range(1, saved + 3))
    assert tracker.read_text().strip() == str(saved + 2)


# ------------------------------------------------------------------------------------------
# (f) Weights & Biases, offline
# ------------------------------------------------------------------------------------------


def wandb_records(run_file: Path) -> list:
    """The records of a W&B run file (``run-<id>.wandb``): LevelDB's log format (32 KiB
    blocks; each chunk a 7-byte header of CRC, length and type: 1 full, 2 first, 3 middle,
    4 last) after a 7-byte file header, each record a ``wandb_internal_pb2.Record``."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, pending, records = run_file.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_file: Path) -> dict:
    """{step: {key: value}} of the metrics logged to a W&B run file."""
    history = {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or ".".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}
            history[items.pop("_step")] = {k: v for k, v in items.items()
                                           if not k.startswith("_")}
    return history


def test_wandb_offline_logs_the_metrics_and_a_resume_continues_the_run(tmp_path):
    import psutil

    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    run_dir = tmp_path / "run"
    env = {"WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
           "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}
    common = ["parallel.tp=2", "checkpoint.save_interval=2", "training.eval_interval=1000",
              "logging.log_interval=1", f"logging.run_dir={run_dir}",
              "logging.wandb.project=mb-test", "logging.wandb.mode=offline"]
    first = run_training(2, [*common, "training.train_iters=4"], env_extra=env)
    run_training(2, [*common, "training.train_iters=6"], env_extra=env)
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert f"W&B: run {run_id} of project mb-test (offline" in first.stdout
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs), runs
    first_run, resumed = (wandb_history(r / f"run-{run_id}.wandb") for r in runs)
    assert sorted(first_run) == [1, 2, 3, 4] and sorted(resumed) == [5, 6]
    # the same scalars as metrics.jsonl (and TensorBoard), from one rank
    for rec in metrics(run_dir):
        logged = {**first_run, **resumed}[rec["iteration"]]
        assert logged["loss"] == rec["loss"] and logged["lr"] == rec["lr"]
        assert set(logged) == {k for k, v in rec.items() if k != "iteration"
                               and isinstance(v, (int, float)) and not isinstance(v, bool)}
    # the resolved configuration: the run record of the first file carries it
    run_record = next(r.run for r in wandb_records(runs[0] / f"run-{run_id}.wandb")
                      if r.WhichOneof("record_type") == "run")
    config = {i.key or ".".join(i.nested_key): json.loads(i.value_json)
              for i in run_record.config.update}
    assert config["parallel"]["tp"] == 2 and config["training"]["device"] == "cpu", config
    assert config["resolved"]["world_size"] == 2, config
    # wandb's background service ended with each run
    left = [p for p in psutil.Process().children(recursive=True) if "wandb" in p.name()]
    assert not left, left


def test_wandb_missing_is_one_line_before_anything_starts(tmp_path):
    """Without the package, the launch check names the key and the extra (the package is
    hidden: a None in sys.modules is what importlib finds for a module that is absent)."""
    env = dict(_env(), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c",
                           "import sys; sys.modules['wandb'] = None; "
                           "from megatron_boost.cli.pretrain import main; "
                           "raise SystemExit(main(sys.argv[1:]))",
                           "--check", "--config", DEBUG, "logging.wandb.project=p",
                           f"logging.run_dir={tmp_path / 'run'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "error: logging.wandb.project is 'p' but wandb is not installed; install the wandb "
        "extra (pip install wandb, or EXTRAS=wandb scripts/setup_env.sh), or set "
        "logging.wandb.project=null"], proc.stderr


# ------------------------------------------------------------------------------------------
# pieces (in-process, fast)
# ------------------------------------------------------------------------------------------


def test_eta_extrapolates_the_mean_step_time_or_the_token_rate():
    from megatron_boost.train.metrics import Progress, format_duration

    # resumed at iteration 10 (1,280 tokens), 100 iterations: 5 steps in 20 s -> 4 s a step
    by_steps = Progress(start_s=100.0, start_iteration=10, start_tokens=1280, train_iters=100)
    assert by_steps.eta_s(100.0, 10, 1280) is None  # nothing measured yet
    assert by_steps.elapsed_s(120.0) == 20.0
    assert by_steps.eta_s(120.0, 15, 1920) == pytest.approx(85 * 4.0)
    # a token budget of 10,000: 640 tokens in 20 s -> 32 tok/s for the 8,080 left
    by_tokens = Progress(100.0, 10, 1280, train_iters=79, train_tokens=10_000)
    assert by_tokens.eta_s(120.0, 15, 1920) == pytest.approx(8080 / 32)
    assert by_tokens.eta_s(130.0, 79, 10_112) == 0  # the last step overshoots the budget
    assert [format_duration(x) for x in (None, 44.6, 725, 11_220, 187_200)] == \
        ["n/a", "45s", "12m05s", "3h07m", "2d04h"]


def test_sampler_continues_and_reshards_by_data_parallel_rank():
    from megatron_boost.train.sampler import ConsumedSamplesSampler

    def take(sampler, n):
        it = iter(sampler)
        return [next(it) for _ in range(n)]

    one = take(ConsumedSamplesSampler(1000, 8, 2, 0, 1), 6)
    assert one == [[8, 9], [10, 11], [12, 13], [14, 15], [16, 17], [18, 19]]
    r0 = take(ConsumedSamplesSampler(1000, 8, 2, 0, 2), 3)
    r1 = take(ConsumedSamplesSampler(1000, 8, 2, 1, 2), 3)
    interleaved = [b for pair in zip(r0, r1) for b in pair]
    assert interleaved == one  # same global order for any DP size
    assert list(ConsumedSamplesSampler(10, 6, 2, 0, 1, stop=10)) == [[6, 7], [8, 9]]
    assert take(ConsumedSamplesSampler(10, 8, 2, 0, 1), 2) == [[8, 9], [0, 1]]  # wraps


def test_flops_per_token_formula():
    from megatron_boost.config.run import load_run_config
    from megatron_boost.analysis.flops import flops_per_token, forward_flops_per_token
    from megatron_boost.runtime.devices import peak_tflops

    cfg = load_run_config(DEBUG)
    d, f, L, h, g, s, V, r = 64, 128, 2, 4, 2, 32, 256, 16
    e = d // h
    low = lambda i, o: 2 * r * (i + o)  # noqa: E731
    dense = lambda i, o: 2 * i * o  # noqa: E731
    core = 4 * s * h * e / 2  # the causal half of the scores (megatron-LM's convention)
    expect_low = L * (low(d, h * e) + 2 * low(d, g * e) + low(h * e, d)
                      + 2 * low(d, f) + low(f, d) + core) + 2 * d * V
    expect_full = L * (dense(d, h * e) + 2 * dense(d, g * e) + dense(h * e, d)
                       + 2 * dense(d, f) + dense(f, d) + core) + 2 * d * V
    assert forward_flops_per_token(cfg, "boost") == expect_low
    assert forward_flops_per_token(cfg, "naive") == expect_low
    assert forward_flops_per_token(cfg, "full") == expect_full
    assert flops_per_token(cfg, "boost") == 3 * expect_low
    assert peak_tflops(None, "cpu") is None and peak_tflops(123.0, "cpu") == 123.0


def test_checkpoint_of_another_format_version_is_refused():
    from megatron_boost.train.checkpointing import CHECKPOINT_FORMAT_VERSION, check_format_version

    check_format_version({"format_version": CHECKPOINT_FORMAT_VERSION}, "iter_0000003")
    with pytest.raises(ValueError, match=r"iter_0000003 has format version 0; this megatron-boost "
                                         rf"reads format version {CHECKPOINT_FORMAT_VERSION}"):
        check_format_version({"format_version": 0}, "iter_0000003")
