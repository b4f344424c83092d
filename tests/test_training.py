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


def _cmd(nproc: int, overrides, config: str = DEBUG):
    if nproc == 1:
        launch = [sys.executable, ENTRY]
    else:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                  f"--nproc_per_node={nproc}", ENTRY]
    return launch + ["--config", config, *overrides]


def run_training(nproc: int, overrides, check: bool = True, config: str = DEBUG,
                 env_extra=None, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """``pretrain_lowrank.py --config <config> <overrides>`` on ``nproc`` ranks of the rank pool
    (tests/rank_pool.py), with the environment a launch of these tests gets (plus
    ``env_extra``, e.g. a fault-injection hook)."""
    proc = pool().run(nproc, ["--config", config, *overrides],
                      env=dict(_env(), **(env_extra or {})), cwd=str(ROOT), timeout=timeout)
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
    assert (run_dir / "config.yaml").is_file()


# ------------------------------------------------------------------------------------------
# (b) exact resume with the distributed optimizer
# ------------------------------------------------------------------------------------------


@pytest.mark.compat
def test_resume_reproduces_uninterrupted_run_exactly(base, tmp_path):
    run_dir, _ = base
    ckpt = run_dir / "checkpoints" / "iter_0000003"
    proc = run_training(2, BASE + [f"logging.run_dir={tmp_path}", f"checkpoint.load={ckpt}"])
    assert "resumed from" in proc.stdout and "at iteration 3" in proc.stdout
    ref, got = losses(run_dir), losses(tmp_path)
    assert sorted(got) == [4, 5, 6]
    for it in (4, 5, 6):
        assert got[it] == ref[it], (it, got[it], ref[it])  # fp32 CPU: bit-identical
    ref_recs = {r["iteration"]: r for r in metrics(run_dir)}
    for r in metrics(tmp_path):
        assert r["lr"] == ref_recs[r["iteration"]]["lr"]
        assert r["grad_norm"] == ref_recs[r["iteration"]]["grad_norm"]


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
# pieces (in-process, fast)
# ------------------------------------------------------------------------------------------


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
    from megatron_boost.analysis.flops import flops_per_token, forward_flops_per_token, peak_tflops

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
