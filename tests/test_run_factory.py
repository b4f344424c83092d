"""One way to build a run (megatron_boost/train/build.py, docs/design.md §9): every entry point
that builds a model, given the same configuration, builds the same megatron TransformerConfig,
the same rotary table and the same initial weights.

One process (TP = PP = 1, where every entry point can run, the conversion tools included):
the trainer (which also saves its untrained checkpoint), the equivalence harness, the benchmark,
the precision check (its fp32 model), the importer's initialised model, and the models the
exporter / generator and the evaluator load from the trainer's checkpoint. Weights must be
bitwise equal: all are drawn by the same layout-independent initialisation from one seed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.rank_pool import distributed

MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
             vocab_size=300, seq_length=16, attn_rank=16, mlp_rank=16, rotary_base=5000)
SEED = 77


def _overrides(run_dir: str, mode: str):
    return ([f"model.{k}={v}" for k, v in MODEL.items()]
            + [f"parallel.mode={mode}", f"training.seed={SEED}", "training.train_iters=1",
               "training.eval_iters=0", "optimizer.warmup_iters=0", "training.micro_batch_size=2",
               "training.global_batch_size=2", "data.mock=true", f"logging.run_dir={run_dir}",
               "logging.tensorboard=false"])


def _facts(chunks) -> dict:
    """What must agree: the megatron config's plain fields, the rotary table, the weights."""
    from megatron_boost.model.init import sharded_params

    module = chunks[0]
    while hasattr(module, "module"):  # DDP, Float16Module
        module = module.module
    config = module.config
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if not callable(getattr(config, f.name))}
    return {"config": fields, "inv_freq": module.rotary_pos_emb.inv_freq.detach().clone(),
            "weights": {k: p.detach().float().clone() for k, _, _, p in sharded_params(module)}}


def _entry_points(rank, world, run_dir: str, mode: str) -> dict:
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    from megatron_boost.cli.benchmark import build_mode_run
    from megatron_boost.cli.precision_check import precision_models
    from megatron_boost.config.resolved import resolve_run
    from megatron_boost.config.run import load_run_config
    from megatron_boost.convert import megatron_side as mb
    from megatron_boost.config.layout import Layout
    from megatron_boost.testing.verification import LayoutSpec, build_layout
    from megatron_boost.train.step import initialize_parallel
    from megatron_boost.train.trainer import Trainer

    cfg = load_run_config(None, _overrides(run_dir, mode), world_size=1)
    out = {}
    trainer = Trainer(cfg, "cpu")
    out["trainer"] = _facts(trainer.model)
    trainer.save()  # iteration 0: the untrained weights, for the tools that load a checkpoint
    trainer.writer.close()
    parallel_state.destroy_model_parallel()
    destroy_num_microbatches_calculator()

    spec = LayoutSpec(layout=Layout(mode=mode), model=dict(MODEL),
                      seq_length=MODEL["seq_length"], seed=SEED,
                      micro_batch_size=2, global_batch_size=2)
    out["verification"] = _facts(build_layout(spec)[1].chunks)
    parallel_state.destroy_model_parallel()

    initialize_parallel(1, 1, None, SEED)
    job = {"cfg": cfg, "tp": 1, "pp": 1, "seq_length": MODEL["seq_length"],
           "micro_batch_size": 2, "global_batch_size": 2, "dtype": "fp32", "recompute": None,
           "seed": SEED}
    out["benchmark"] = _facts(build_mode_run(job, mode)["ddp"])
    out["precision_check"] = _facts([precision_models(resolve_run(cfg))[0]])
    ckpt = mb.resolve_checkpoint(f"{run_dir}/checkpoints")
    rows = mb.saved_vocab_rows(ckpt)
    out["import"] = _facts([mb.initialised_single_model(cfg, rows)])
    exported = mb.build_single_model(cfg, rows)
    mb.load_weights(exported, ckpt)
    out["export_generate"] = _facts([exported])
    out["evaluate"] = _facts(mb.launched_model(cfg, ckpt, torch.device("cpu")))
    parallel_state.destroy_model_parallel()
    return out


MODES = ["boost", "full"]


def _both_modes(rank, world, run_dirs: dict) -> dict:
    """Each mode's entry points, one mode after the other in one process (a process start
    costs seconds of imports; each mode's builds only compare among themselves)."""
    return {mode: _entry_points(rank, world, run_dir, mode) for mode, run_dir in run_dirs.items()}


@pytest.fixture(scope="module")
def built_modes(tmp_path_factory):
    run_dirs = {mode: str(tmp_path_factory.mktemp(f"factory-{mode}")) for mode in MODES}
    return distributed(_both_modes, 1, run_dirs, timeout=600)[0]


@pytest.fixture(params=MODES)
def built(request, built_modes):
    return built_modes[request.param]


ENTRY_POINTS = ["verification", "benchmark", "precision_check", "import", "export_generate",
                "evaluate"]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_entry_point_builds_the_trainers_model(built, entry):
    ref, got = built["trainer"], built[entry]
    diff = {k: (ref["config"][k], got["config"].get(k)) for k in ref["config"]
            if ref["config"][k] != got["config"].get(k)}
    assert not diff, f"{entry}: TransformerConfig differs from the trainer's: {diff}"
    assert torch.equal(ref["inv_freq"], got["inv_freq"]), f"{entry}: rotary base differs"
    assert ref["weights"].keys() == got["weights"].keys()
    for key, value in ref["weights"].items():
        assert torch.equal(value, got["weights"][key]), f"{entry}: initial {key} differs"


def test_resolved_vocabulary_is_the_tokenizers(tmp_path):
    """The padded vocabulary comes from the tokenizer the data section names, not from
    model.vocab_size (the precision check once padded the latter)."""
    from megatron_boost.config.resolved import padded_vocab_size, resolve_run
    from megatron_boost.config.run import load_run_config

    class Tokenizer:
        vocab_size = 1000

    cfg = load_run_config(None, ["model.vocab_size=300", "parallel.tp=2",
                                 "data.tokenizer_model=some.model"])
    run = resolve_run(cfg, "cpu", tokenizer=Tokenizer())
    assert run.vocab_size == 1000 and run.padded_vocab_size == padded_vocab_size(1000, 2) == 1024
    no_tokenizer = resolve_run(load_run_config(None, ["model.vocab_size=300"]), "cpu")
    assert no_tokenizer.vocab_size == 300 and no_tokenizer.padded_vocab_size == 384


def _embedding_outputs(rank, world) -> dict:
    """{mode: (training-mode output, eval-mode output)} of the built model's embedding at
    TP 1 with model.hidden_dropout=0.5, the default generator seeded alike before each."""
    from megatron.core import parallel_state

    from megatron_boost.config.resolved import resolve_run
    from megatron_boost.config.run import load_run_config
    from megatron_boost.train.build import build_run
    from megatron_boost.train.step import initialize_parallel

    initialize_parallel(1, 1, None, SEED)
    tokens = torch.randint(0, MODEL["vocab_size"], (2, MODEL["seq_length"]),
                           generator=torch.Generator().manual_seed(SEED))  # [b, s]
    out = {}
    try:
        for mode in ("full", "naive", "boost"):
            cfg = load_run_config(None, [*(f"model.{k}={v}" for k, v in MODEL.items()),
                                         f"parallel.mode={mode}", f"training.seed={SEED}",
                                         "model.hidden_dropout=0.5"])
            embedding = build_run(resolve_run(cfg, "cpu"), training=False).chunks[0].embedding
            torch.manual_seed(SEED)
            dropped = embedding.train()(tokens, None)  # [s, b, d]
            out[mode] = (dropped.detach(), embedding.eval()(tokens, None).detach())
    finally:
        parallel_state.destroy_model_parallel()
    return out


def test_every_mode_drops_the_same_embedding_entries_at_tp1():
    """megatron's embedding dropout (model.hidden_dropout) in every mode: boost's own hidden-
    sharded embedding applies it as megatron's LanguageModelEmbedding does in full and naive,
    so the same initial table, seed and tokens give bitwise the same output."""
    out = distributed(_embedding_outputs, 1)[0]
    dropped, kept = out["full"]
    zeroed = (dropped == 0) & (kept != 0)
    assert 0.4 < zeroed.float().mean() < 0.6  # half dropped, the rest scaled by 1 / (1 - p)
    assert torch.equal(dropped[~zeroed], 2 * kept[~zeroed])
    for mode in ("naive", "boost"):
        assert torch.equal(out[mode][0], dropped), mode
        assert torch.equal(out[mode][1], kept), mode
