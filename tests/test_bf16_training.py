"""bf16 end to end through the real entry point (pretrain_lowrank.py), every mode, on CPU.

torch runs bf16 on the CPU, so the GPU precision path (megatron's Float16Module, the bf16
optimizer with fp32 main parameters, fp32 gradient reduction) is exercised here. Per mode:

* ``ref``: TP=2, distributed optimizer, 4 iterations, checkpoints at 2 and 4;
* exact resume: a TP=2 run from the iteration-2 checkpoint reproduces iterations 3-4 bit for
  bit (same layout, same arithmetic);
* resharding: the same checkpoint resumed at TP=1 (one process) runs iterations 3-4 with
  losses within bf16 tolerance of the TP=2 run. 2e-2 relative: TP=1 sums the sharded GEMMs and
  all-reduces in another order, and in bf16 (8-bit mantissa, 4e-3 per rounding) that moves the
  mean loss by ~1e-3; a checkpoint that did not load (fresh weights, loss ~ln 256 = 5.5 against
  a trained ~5.3) or lost its optimizer state differs by more.
"""

from __future__ import annotations

import pytest

from tests.test_training import losses, run_training

BF16 = ["training.precision=bf16", "parallel.use_distributed_optimizer=true",
        "training.train_iters=4", "checkpoint.save_interval=2", "training.eval_interval=100",
        "logging.log_interval=1", "optimizer.lr_decay_iters=4"]
MODES = ("full", "naive", "boost")


@pytest.fixture(scope="module", params=MODES)
def ref_run(request, tmp_path_factory):
    mode = request.param
    run_dir = tmp_path_factory.mktemp(f"bf16_{mode}")
    proc = run_training(2, BF16 + [f"parallel.mode={mode}", "parallel.tp=2",
                                   f"logging.run_dir={run_dir}"])
    return mode, run_dir, proc


def test_bf16_run_trains(ref_run):
    mode, run_dir, proc = ref_run
    assert "precision=bf16" in proc.stdout
    got = losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4]
    assert got[4] < got[1], got
    assert (run_dir / "checkpoints" / "iter_0000002" / "metadata.json").is_file()


def _resume_from_iteration_2(ref_run, tmp_path, nproc):
    """Resume the reference run's iteration-2 checkpoint at TP=nproc; (ref, resumed) losses."""
    mode, run_dir, _ = ref_run
    ckpt = run_dir / "checkpoints" / "iter_0000002"
    proc = run_training(nproc, BF16 + [f"parallel.mode={mode}", f"parallel.tp={nproc}",
                                       f"logging.run_dir={tmp_path}", f"checkpoint.load={ckpt}"])
    assert "at iteration 2" in proc.stdout and "saved layout tp=2 pp=1" in proc.stdout
    got = losses(tmp_path)
    assert sorted(got) == [3, 4]
    return losses(run_dir), got


def test_bf16_resume_is_exact(ref_run, tmp_path):
    ref, got = _resume_from_iteration_2(ref_run, tmp_path, nproc=2)
    for it in (3, 4):
        assert got[it] == ref[it], (ref_run[0], it, got[it], ref[it])


def test_bf16_checkpoint_reshards_tp2_to_tp1(ref_run, tmp_path):
    ref, got = _resume_from_iteration_2(ref_run, tmp_path, nproc=1)
    for it in (3, 4):
        assert got[it] == pytest.approx(ref[it], rel=2e-2), (ref_run[0], it, got[it], ref[it])
