"""Muon orthogonalises each projection's global matrix, in every mode and layout (train/muon.py).

Trainer runs (configs/debug.yaml through the entry point, tests/rank_pool.py): Muon at TP=2 in
boost with low-rank recompute (fp32) and in naive (bf16), gradient clipping on; the iteration-2
checkpoint resumed at TP=2 reproduces iterations 3-4 bit for bit (Muon's momentum included: a
resume without the optimizer state differs), and resumed at TP=1 matches within the precision's
tolerance.

Equivalence: one and three Muon steps (the same global batch each step, gradient clipping on)
at TP=2 in each mode and at PP=2 change every parameter shard as the one-process run does
(verification.py's harness: bottleneck modes against the one-process naive model, full against
the one-process full model). Reference: Muon written here from the published algorithm (Jordan
2024: momentum, Nesterov, quintic Newton-Schulz of the global matrix, scale, decoupled weight
decay) gives the one-process run's update of every global matrix A_p, B_p. Negative controls: a
Muon that orthogonalises the grouped A's concatenation, or each rank's shard, fails both.
"""

from __future__ import annotations

import pytest
import torch

from megatron_boost.config.layout import Layout
from megatron_boost.config.run import load_run_config
from megatron_boost.config import validation
from megatron_boost.testing.verification import (
    TOLERANCES,
    LayoutSpec,
    build_layout,
    layout_batches,
    reference_spec,
    run_many,
)
from megatron_boost.train import muon as muon_module
from tests.rank_pool import distributed
from tests.test_training import losses, run_training

pytestmark = pytest.mark.compat

MODEL = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=8,
             num_query_groups=4, vocab_size=100, attn_rank=8, mlp_rank=8)
MUON = {"name": "muon"}

# Muon's tolerance on the parameters' total change, relative to each tensor's largest reference
# entry. The layouts' gradients agree to fp32 rounding (observed ≤ 2e-6 relative after one
# step, ≤ 1.4e-5 after three); Newton-Schulz is a fixed polynomial of the normalised momentum
# whose slope at small singular values is up to a^steps (a ≈ 3.4, five steps: ~5e2), so a
# rounding-level gradient difference moves the update by up to ~1e-3 of its largest entry.
# Observed ≤ 6e-5 (boost TP=2, one step). The negative controls change whole updates:
# observed ≥ 0.98 relative, 1000× this tolerance.
UPDATE_TOL = 1e-3


def L(mode, tp=1, pp=1, steps=1, **kw):
    return LayoutSpec(layout=Layout(mode=mode, tp=tp, pp=pp), model=dict(MODEL),
                      optimizer=dict(MUON), steps=steps, **kw)


# (id, spec, wrong Muon or None): all on two ranks.
LAYOUTS = [(f"{mode}-{par}-steps{steps}", L(mode, steps=steps, **{par[:2]: 2}), None)
           for steps in (1, 3) for mode, par in
           (("boost", "tp2"), ("naive", "tp2"), ("full", "tp2"), ("boost", "pp2"))]
NEGATIVE = [("NEG-concat-boost-tp2", L("boost", tp=2), "concat"),
            ("NEG-shard-boost-tp2", L("boost", tp=2), "shard"),
            ("NEG-shard-naive-tp2", L("naive", tp=2), "shard")]


class _WrongMuon:
    """A Muon that orthogonalises the wrong matrix, for the negative controls (restored after:
    the rank processes stay up)."""

    def __init__(self, wrong):
        self.wrong = wrong
        self.saved = {}

    def __enter__(self):
        cls = muon_module.BoostMuon
        if self.wrong == "concat":  # the grouped A as one matrix
            update = cls.orthogonal_update
            self._patch("orthogonal_update",
                        lambda self, p, d, rows: update(self, p, d, None))
        elif self.wrong == "shard":  # each rank's shard as a whole matrix
            shard = cls._orthogonalised_shard
            self._patch("_orthogonalised_shard",
                        lambda self, piece, axis: shard(self, piece, None))
        return self

    def _patch(self, name, fn):
        self.saved[name] = getattr(muon_module.BoostMuon, name)
        setattr(muon_module.BoostMuon, name, fn)

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(muon_module.BoostMuon, name, fn)


def _layouts(rank, world, jobs):
    out = []
    for spec, reference, wrong in jobs:
        with _WrongMuon(wrong):
            out.extend(run_many(rank, world, [(spec, reference)]))
    return out


def _key(spec):
    r = reference_spec(spec)
    return (r.layout.mode, r.steps)


@pytest.fixture(scope="module")
def results():
    wanted = LAYOUTS + NEGATIVE
    refs_needed = {}
    for _, spec, _ in wanted:
        refs_needed.setdefault(_key(spec), reference_spec(spec))
    ref_out = distributed(_layouts, 1, [(s, None, None) for s in refs_needed.values()])[0]
    refs = dict(zip(refs_needed, ref_out))
    jobs = [(spec, refs[_key(spec)], wrong) for _, spec, wrong in wanted]
    per_rank = distributed(_layouts, 2, jobs, timeout=600)
    return {name: [r[i] for r in per_rank] for i, (name, _, _) in enumerate(wanted)}


@pytest.mark.parametrize("name", [n for n, _, _ in LAYOUTS])
def test_muon_layout_equals_one_process(results, name):
    per_rank = results[name]
    assert max(r["loss"] for r in per_rank if r["loss"] is not None) <= TOLERANCES["loss"]
    assert max(r["grad"] for r in per_rank) <= TOLERANCES["grad"]
    worst = max(r["update"] for r in per_rank)
    assert worst <= UPDATE_TOL, f"update rel diff {worst}"
    assert all(r["n_tensors"] > 0 for r in per_rank)


@pytest.mark.parametrize("name", [n for n, _, _ in NEGATIVE])
def test_muon_negative_control_is_caught(results, name):
    worst = max(r["update"] for r in results[name])
    assert worst > 100 * UPDATE_TOL, f"update rel diff {worst}"


# ---------------------------------------------------------------------------------------------
# a reference Muon, written from the published algorithm, on the one-process model
# ---------------------------------------------------------------------------------------------

# Keller Jordan's Muon (2024): the quintic iteration, its coefficients and normalisation.
JORDAN = (3.4445, -4.7750, 2.0315)


def reference_orthogonalise(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = JORDAN
    x = g.double() / (g.double().norm() + 1e-7)
    tall = g.shape[0] > g.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


def reference_update(p, g, lr, wd, beta=0.95, extra=0.2):
    """The first Muon step of a global matrix: momentum (1 − β)·g, Nesterov direction, spectral
    scale √max(m, n)·extra, decoupled weight decay (Liu et al. 2025)."""
    momentum = (1 - beta) * g
    direction = g + beta * (momentum - g)
    scale = max(g.shape) ** 0.5 * extra
    return -lr * wd * p - lr * scale * reference_orthogonalise(direction)


def _one_process_vs_reference(rank, world, mode, wrong):
    """Worst relative difference between the one-process Muon update of every global matrix
    (A_p, B_p, full mode's weights) and the reference's, and how many were compared."""
    from megatron_boost.train.step import train_step
    from megatron.core import parallel_state

    spec = L(mode)
    with _WrongMuon(wrong):
        cfg, built, entries = build_layout(spec)
        matrices = [(key, param) for key, shape, _, param in entries if len(shape) == 2
                    and "embedding" not in key and "output_layer" not in key]
        before = {key: param.detach().clone() for key, param in matrices}
        micro = layout_batches(spec, cfg.model.vocab_size, 1, 0)
        result = train_step(built.forward_step, [iter(micro)], built.chunks, built.optimizer,
                            len(micro), spec.seq_length, spec.micro_batch_size)
    group = built.optimizer.param_groups[0]
    assert result["grad_norm"] > cfg.optimizer.clip_grad  # clipping is part of the check
    worst = 0.0
    for key, param in matrices:
        # megatron clips the gradients in place before the step: main_grad is what Muon saw.
        grad = _global_grad(built, key, param)
        expected = reference_update(before[key], grad, group["lr"], group["weight_decay"])
        actual = param.detach() - before[key]
        worst = max(worst, float((actual - expected).abs().max() / expected.abs().max()))
    parallel_state.destroy_model_parallel()
    return worst, len(matrices)


def _global_grad(built, key, param):
    """The gradient of one global matrix (a grouped A's rows: its rows of the main_grad)."""
    for chunk in built.chunks:
        for p in chunk.parameters():
            if p.data_ptr() <= param.data_ptr() < p.data_ptr() + p.numel() * p.element_size():
                offset = (param.data_ptr() - p.data_ptr()) // p.element_size()
                return p.main_grad.view(-1)[offset:offset + param.numel()].view_as(param)
    raise KeyError(key)


@pytest.mark.parametrize("mode", ["naive", "boost", "full"])
def test_one_process_muon_matches_reference(mode):
    worst, n = distributed(_one_process_vs_reference, 1, mode, None)[0]
    # Both are the same fp32 arithmetic on the same gradient up to summation order (the test's
    # in fp64): observed ≤ 1e-5.
    assert n >= 4 * MODEL["num_layers"] and worst <= 1e-4, (worst, n)


def test_one_process_reference_catches_concatenated_group():
    worst, _ = distributed(_one_process_vs_reference, 1, "naive", "concat")[0]
    assert worst > 0.1, worst


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("override,needle", [
    ("optimizer.name=lion", "optimizer.name ('lion') must be one of adamw, muon; adamw: "),
    ("optimizer.muon_momentum=1.0", "optimizer.muon_momentum (1.0) must be in [0, 1)"),
    ("optimizer.muon_momentum=-0.1", "optimizer.muon_momentum (-0.1) must be in [0, 1)"),
    ("optimizer.muon_ns_steps=0", "optimizer.muon_ns_steps (0) must be >= 1"),
    ("optimizer.muon_ns_coefficients=cubic",
     "optimizer.muon_ns_coefficients ('cubic') must be one of jordan, tuned5"),
    ("optimizer.muon_scale=rms", "optimizer.muon_scale ('rms') must be one of spectral"),
    ("optimizer.muon_extra_scale=0", "optimizer.muon_extra_scale (0.0) must be > 0"),
    ("parallel.use_distributed_optimizer=true",
     "set parallel.use_distributed_optimizer false or optimizer.name adamw"),
])
def test_bad_muon_settings_are_refused(override, needle):
    overrides = [override] + (["optimizer.name=muon"] if "name=" not in override else [])
    with pytest.raises(ValueError) as err:
        load_run_config(None, overrides)
    assert needle in str(err.value)


@pytest.mark.fast
def test_validation_names_what_muon_implements():
    assert set(validation._NS_COEFFICIENTS) == set(muon_module.NS_COEFFICIENTS)
    assert set(validation._MUON_SCALES) == set(muon_module.SCALE_RULES)
    assert load_run_config(None, ["optimizer.name=muon"]).optimizer.name == "muon"


@pytest.mark.fast
def test_newton_schulz_orthogonalises():
    g = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    for coefficients, steps in (("jordan", 5), ("tuned5", 5)):
        x = muon_module.newton_schulz(g, muon_module.NS_COEFFICIENTS[coefficients], steps)
        singular = torch.linalg.svdvals(x)
        # Jordan's iteration leaves the singular values in about [0.7, 1.2], not at 1.
        assert singular.min() > 0.6 and singular.max() < 1.25, singular
        # The same singular vectors as g's polar factor U·Vᵀ: x·(U·Vᵀ)ᵀ is positive definite.
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        assert torch.linalg.eigvalsh((x @ (u @ vh).T + (u @ vh) @ x.T) / 2).min() > 0.5
    tall = muon_module.newton_schulz(g.T, muon_module.NS_COEFFICIENTS["jordan"], 5)
    assert torch.allclose(tall, muon_module.newton_schulz(
        g, muon_module.NS_COEFFICIENTS["jordan"], 5).T, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# the trainer: recompute, bf16, clipping, checkpoint resume (exact, and into TP=1)
# ---------------------------------------------------------------------------------------------

TRAIN = ["optimizer.name=muon", "parallel.tp=2", "training.train_iters=4",
         "checkpoint.save_interval=2", "training.eval_interval=100", "logging.log_interval=1",
         "optimizer.lr_decay_iters=4", "optimizer.clip_grad=0.5"]
# (id, overrides, TP=1 tolerance): fp32 differs by summation order only (~1e-6 relative on the
# loss after a Muon step, see UPDATE_TOL); bf16 as tests/test_bf16_training.py argues (2e-2).
RUNS = [("boost-fp32-lowrank-recompute", ["parallel.mode=boost", "training.recompute=lowrank"],
         1e-5),
        ("naive-bf16", ["parallel.mode=naive", "training.precision=bf16"], 2e-2)]


@pytest.fixture(scope="module", params=RUNS, ids=[r[0] for r in RUNS])
def muon_run(request, tmp_path_factory):
    name, overrides, tol = request.param
    run_dir = tmp_path_factory.mktemp(name)
    proc = run_training(2, TRAIN + overrides + [f"logging.run_dir={run_dir}"])
    return overrides, tol, run_dir, proc


def _resume(muon_run, tmp_path, nproc, extra=()):
    overrides, _, run_dir, _ = muon_run
    ckpt = run_dir / "checkpoints" / "iter_0000002"
    proc = run_training(nproc, TRAIN + overrides + [
        f"parallel.tp={nproc}", f"logging.run_dir={tmp_path}", f"checkpoint.load={ckpt}",
        *extra])
    assert "at iteration 2" in proc.stdout
    got = losses(tmp_path)
    assert sorted(got) == [3, 4]
    return losses(run_dir), got


def test_muon_run_trains(muon_run):
    _, _, run_dir, proc = muon_run
    assert "optimizer=muon" in proc.stdout
    got = losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4] and got[4] < got[1], got


def test_muon_resume_is_exact(muon_run, tmp_path):
    ref, got = _resume(muon_run, tmp_path, nproc=2)
    assert [got[it] for it in (3, 4)] == [ref[it] for it in (3, 4)], (ref, got)


def test_muon_resume_without_its_state_differs(muon_run, tmp_path):
    """The exact resume above needs the momentum from the checkpoint: without it (weights
    only) iteration 4 differs."""
    ref, got = _resume(muon_run, tmp_path, nproc=2, extra=["checkpoint.no_load_optim=true"])
    assert got[4] != ref[4], (ref, got)


def test_muon_checkpoint_reshards_tp2_to_tp1(muon_run, tmp_path):
    _, tol, _, _ = muon_run
    ref, got = _resume(muon_run, tmp_path, nproc=1)
    for it in (3, 4):
        assert got[it] == pytest.approx(ref[it], rel=tol), (it, got[it], ref[it])


@pytest.mark.fast
def test_environment_report_names_muon():
    from megatron_boost.cli.env import environment_report

    rows = dict(environment_report()[0])
    assert "BoostMuon" in rows["optimizer.name: muon"]
