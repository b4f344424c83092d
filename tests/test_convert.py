"""HF export/import: every checkpoint layout exports the same tensors, HF logits equal megatron's,
fold gives a plain Llama, import is exact (full rank, full-rank SVD) or reports the SVD tail
energy (low rank), export -> import is bit-exact, bad input ends in one error line.

Checkpoints come from the real trainer (2 iterations) with lr = min_lr = 0: the weights stay the
trainer's layout-independent initialisation (docs/design.md §8), which the test recomputes at
TP = 1 without dist_checkpointing, so "identical tensors in every layout" has an independent
reference. Trained weights are covered by the logit checks (export verifies every export).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_boost.convert import megatron_side as mb  # noqa: E402
from megatron_boost.convert.export import LOGIT_TOLERANCE, attention_shape  # noqa: E402
from megatron_boost.convert.mapping import megatron_to_hf  # noqa: E402

#: fp32 logits of one function evaluated in two op orders (HF vs megatron kernels, SVD in
#: float64 rounded to fp32) agree to ~1e-6 of their O(1) scale; a wrong layout is off by O(1).
EXACT = 1e-4

LAYOUTS = {
    "boost_tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    "naive_tp2": (2, ["parallel.mode=naive", "parallel.tp=2"]),
    "full_tp2": (2, ["parallel.mode=full", "parallel.tp=2"]),
    "boost_distopt_identity": (2, ["parallel.use_distributed_optimizer=true",
                                   "model.bottleneck_activation=identity"]),
}


def sample_text() -> str:
    """ASCII text for the tokenizer (byte fallback covers the rest)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return "".join(c for c in text if c == "\n" or 32 <= ord(c) < 127)


@pytest.fixture(scope="session")
def tokenizer_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    (d / "text.txt").write_text(sample_text())
    subprocess.run([sys.executable, str(ROOT / "tools/train_tokenizer.py"), "--input",
                    str(d / "text.txt"), "--vocab-size", "400", "--model-prefix",
                    str(d / "tok"), "--num-threads", "1"], check=True, capture_output=True)
    return str(d / "tok.model")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, tokenizer_model):
    """checkpoint(name) -> run directory's checkpoints folder (trained once per session)."""
    made = {}

    def get(name):
        if name not in made:
            nproc, overrides = LAYOUTS[name]
            run = tmp_path_factory.mktemp(name)
            env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
            proc = subprocess.run(
                [TORCHRUN, f"--nproc_per_node={nproc}", str(ROOT / "pretrain_lowrank.py"),
                 "--config", str(ROOT / "configs/debug.yaml"), *overrides,
                 "training.train_iters=2", "optimizer.warmup_iters=1", "optimizer.lr=0",
                 "optimizer.min_lr=0", "training.eval_iters=0", "data.mock=true",
                 f"data.tokenizer_model={tokenizer_model}", f"logging.run_dir={run}",
                 "logging.tensorboard=false"], env=env, capture_output=True, text=True)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            made[name] = str(run / "checkpoints")
        return made[name]

    return get


def reference_hf(ckpt: str, fold: bool = False) -> dict:
    """The HF tensors of the checkpoint's untrained model, computed at TP = 1 from the seed."""
    path = mb.resolve_checkpoint(ckpt)
    cfg, _ = mb.saved_run_config(path)
    with mb.single_process():
        model = mb.initialised_single_model(cfg, mb.saved_vocab_rows(path))
        weights = {k: v.detach().clone() for k, v in mb.global_weights(model).items()}
    return megatron_to_hf(weights, attention_shape(cfg), mb.is_lowrank(cfg), fold)


def read_safetensors(d: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def export(ckpt, out, *args) -> int:
    from megatron_boost.cli.export_hf import main

    return main([str(ckpt), str(out), *args])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_export_any_layout_gives_the_tp1_tensors(layout, checkpoint, tmp_path, capsys):
    ckpt = checkpoint(layout)
    assert export(ckpt, tmp_path / "hf", "--max-shard-size", "100KB") == 0
    out = capsys.readouterr().out
    assert "greedy tokens (8) agree" in out, out
    exported = read_safetensors(tmp_path / "hf")
    reference = reference_hf(ckpt)
    assert sorted(exported) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor), name
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()  # sharded at 100KB
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    lowrank = layout != "full_tp2"
    assert config["architectures"] == ["ColaForCausalLM" if lowrank else "LlamaForCausalLM"]
    assert (tmp_path / "hf" / "modeling_cola.py").is_file() == lowrank


def test_exported_tokenizer_gives_training_ids(checkpoint, tmp_path, tokenizer_model):
    from transformers import AutoTokenizer

    from megatron_boost.data.datasets import DataConfig

    assert export(checkpoint("full_tp2"), tmp_path / "hf") == 0
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ours = mb.build_tokenizer(DataConfig(tokenizer_model=tokenizer_model))
    text = sample_text()[:4000] + "\n  two  spaces, ünïcode 🙂 and\ttabs "
    assert hf_tok(text)["input_ids"] == list(ours.tokenize(text))
    assert hf_tok(" Hello")["input_ids"] == list(ours.tokenize(" Hello"))


def test_hf_model_reproduces_megatron_and_catches_a_transposed_weight(checkpoint, tmp_path):
    from megatron_boost.convert.export import compare_with_hf
    from megatron_boost.convert.hf_dir import load_hf_model

    ckpt = checkpoint("full_tp2")
    assert export(ckpt, tmp_path / "hf") == 0
    hf_model = load_hf_model(tmp_path / "hf")
    path = mb.resolve_checkpoint(ckpt)
    cfg, _ = mb.saved_run_config(path)
    prompt = list(range(5, 21))
    with mb.single_process():
        model = mb.build_single_model(cfg, mb.saved_vocab_rows(path))
        mb.load_weights(model, path)
        delta, agree, _ = compare_with_hf(model, hf_model, prompt)
        assert delta < EXACT and agree
        o_proj = hf_model.model.layers[0].self_attn.o_proj.weight  # square [d, d]
        o_proj.data = o_proj.data.t().contiguous()  # negative control
        delta, _, _ = compare_with_hf(model, hf_model, prompt)
        assert delta > LOGIT_TOLERANCE


def test_fold_writes_plain_llama(checkpoint, tmp_path, capsys):
    ckpt = checkpoint("boost_distopt_identity")
    assert export(ckpt, tmp_path / "hf", "--fold") == 0
    assert "greedy tokens (8) agree" in capsys.readouterr().out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in config
    assert config["hidden_act"] == "linear"  # no gate non-linearity (mlp_gate_activation off)
    assert not list((tmp_path / "hf").glob("*.py"))
    exported, reference = read_safetensors(tmp_path / "hf"), reference_hf(ckpt, fold=True)
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor), name
