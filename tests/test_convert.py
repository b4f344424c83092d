"""HF export/import: every checkpoint layout exports the same tensors, HF logits equal megatron's,
fold gives a plain Llama, import is exact (full rank, full-rank SVD) or reports the SVD tail
energy (low rank), export -> import is bit-exact, bad input ends in one error line.

Checkpoints come from the real trainer (one iteration, conftest.py) with lr = min_lr = 0: the
weights stay the trainer's layout-independent initialisation (docs/design.md §8), which the test
recomputes at TP = 1 without dist_checkpointing, so "identical tensors in every layout" has an
independent reference. Trained weights are covered by the logit checks (export verifies every export).
"""

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_boost.convert import megatron_side as mb  # noqa: E402
from megatron_boost.convert.export import LOGIT_TOLERANCE, attention_shape  # noqa: E402
from megatron_boost.convert.mapping import megatron_to_hf  # noqa: E402
from tests.convert_fixtures import (  # noqa: E402
    FROZEN_TRAINING,
    LAYOUTS,
    ROOT,
    random_llama,
    sample_text,
    torchrun,
    train,
)

#: fp32 logits of one function evaluated in two op orders (HF vs megatron kernels, SVD in
#: float64 rounded to fp32) agree to ~1e-6 of their O(1) scale; a wrong layout is off by O(1).
EXACT = 1e-4


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
    assert config["tie_word_embeddings"] == layout.endswith("_tied")
    assert ("lm_head.weight" in exported) != layout.endswith("_tied")
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


@pytest.mark.compat
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


# ---------------------------------------------------------------------------------------------
# import
# ---------------------------------------------------------------------------------------------


def import_(hf_dir, out, *overrides) -> int:
    from megatron_boost.cli.import_hf import main

    return main([str(hf_dir), str(out), "--config", str(ROOT / "configs/debug.yaml"),
                 *overrides])


def imported_logits(ckpt_dir, tokens):
    path = mb.resolve_checkpoint(str(ckpt_dir))
    cfg, _ = mb.saved_run_config(path)
    with mb.single_process():
        model = mb.build_single_model(cfg, mb.saved_vocab_rows(path))
        mb.load_weights(model, path)
        return mb.logits(model, tokens)


def hf_logits(hf_dir, tokens):
    from megatron_boost.convert.hf_dir import load_hf_model

    with torch.no_grad():
        return load_hf_model(hf_dir)(tokens).logits


TOKENS = torch.arange(3, 35).remainder(256).unsqueeze(0)  # [1, 32]


@pytest.mark.compat
def test_import_full_rank_is_exact(tmp_path):
    hf = random_llama(tmp_path / "llama")
    assert import_(hf, tmp_path / "ckpt", "parallel.mode=full") == 0
    ours, theirs = imported_logits(tmp_path / "ckpt", TOKENS), hf_logits(hf, TOKENS)
    assert (ours - theirs).abs().max() < EXACT


@pytest.mark.compat
def test_import_at_full_rank_with_identity_is_exact(tmp_path):
    hf = random_llama(tmp_path / "llama", num_key_value_heads=4)  # every min(in, out) = 64
    assert import_(hf, tmp_path / "ckpt", "model.attn_rank=64", "model.mlp_rank=64",
                   "model.bottleneck_activation=identity", "model.mlp_gate_activation=true") == 0
    ours, theirs = imported_logits(tmp_path / "ckpt", TOKENS), hf_logits(hf, TOKENS)
    assert (ours - theirs).abs().max() < EXACT


@pytest.mark.compat
def test_import_low_rank_reports_the_svd_tail_energy(tmp_path):
    from safetensors.torch import load_file

    from megatron_boost.convert.importer import import_hf

    hf = random_llama(tmp_path / "llama")
    result = import_hf(str(hf), str(tmp_path / "ckpt"), str(ROOT / "configs/debug.yaml"))
    state = load_file(str(hf / "model.safetensors"))
    assert len(result["errors"]) == 2 * 7
    for (layer, proj), error in result["errors"].items():
        module = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                  "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                  "down": "mlp.down_proj"}[proj]
        s = torch.linalg.svdvals(state[f"model.layers.{layer}.{module}.weight"].double())
        tail = float((s[16:] ** 2).sum() / (s ** 2).sum()) ** 0.5  # rank 16 (debug.yaml)
        assert error == pytest.approx(tail, rel=1e-9), (layer, proj)


@pytest.mark.fast
@pytest.mark.compat
def test_hf_round_trip_through_a_boost_checkpoint_keeps_the_logits(tmp_path, tokenizer_model):
    """HF LLaMA -> import (boost at full rank, exact) -> export -> HF: the exported model gives
    the source model's logits (an independent reference: no trainer, no megatron on the
    compared side). The fast tier's export round trip."""
    hf = random_llama(tmp_path / "llama", num_key_value_heads=4, vocab_size=512)
    tok = f"data.tokenizer_model={tokenizer_model}"
    assert import_(hf, tmp_path / "ckpt", *BOOST_AT_FULL_RANK, tok) == 0
    assert export(tmp_path / "ckpt", tmp_path / "back") == 0
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["ColaForCausalLM"]  # the boost factors, not a fold
    delta = (hf_logits(tmp_path / "back", TOKENS) - hf_logits(hf, TOKENS)).abs().max()
    assert delta < EXACT, delta


@pytest.mark.compat
def test_tied_hf_model_round_trips_through_a_tied_boost_checkpoint(tmp_path, tokenizer_model):
    """A tied HF LLaMA (tie_word_embeddings) imports as a tied boost model (one table, no
    output layer of its own) and exports back to a tied model with the source's logits."""
    hf = random_llama(tmp_path / "llama", num_key_value_heads=4, vocab_size=512,
                      tie_word_embeddings=True)
    tok = f"data.tokenizer_model={tokenizer_model}"
    assert import_(hf, tmp_path / "ckpt", *BOOST_AT_FULL_RANK, tok) == 0
    cfg, _ = mb.saved_run_config(mb.resolve_checkpoint(str(tmp_path / "ckpt")))
    assert cfg.model.share_embeddings_and_output_weights
    assert export(tmp_path / "ckpt", tmp_path / "back") == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["tie_word_embeddings"]
    delta = (hf_logits(tmp_path / "back", TOKENS) - hf_logits(hf, TOKENS)).abs().max()
    assert delta < EXACT, delta


@pytest.mark.compat
def test_export_import_round_trip_is_bit_exact(checkpoint, tmp_path, tokenizer_model):
    ckpt = checkpoint("boost_tp2_pp2")
    assert export(ckpt, tmp_path / "hf") == 0
    assert import_(tmp_path / "hf", tmp_path / "back", "parallel.tp=2",
                   f"data.tokenizer_model={tokenizer_model}") == 0
    cfg, _ = mb.saved_run_config(mb.resolve_checkpoint(ckpt))
    originals, back = [], []
    for source, into in ((ckpt, originals), (str(tmp_path / "back"), back)):
        path = mb.resolve_checkpoint(source)
        with mb.single_process():
            model = mb.build_single_model(cfg, mb.saved_vocab_rows(path))
            mb.load_weights(model, path)
            into.append({k: v.detach().clone() for k, v in mb.global_weights(model).items()})
    assert originals[0].keys() == back[0].keys()
    for key, tensor in originals[0].items():
        assert torch.equal(back[0][key], tensor), key


# ---------------------------------------------------------------------------------------------
# bad input: one line "error: ...", exit status 2, nothing written
# ---------------------------------------------------------------------------------------------


def _one_error_line(capsys, *words):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for word in words:
        assert word in err[0], err[0]


def test_export_bad_inputs(checkpoint, tmp_path, capsys):
    assert export(tmp_path / "missing", tmp_path / "a") == 2
    _one_error_line(capsys, "missing", "checkpoint")
    (tmp_path / "exists").mkdir()
    assert export(checkpoint("full_tp2"), tmp_path / "exists") == 2
    _one_error_line(capsys, "already exists")
    assert export(checkpoint("full_tp2"), tmp_path / "b", "--fold") == 2
    _one_error_line(capsys, "--fold", "full rank")
    assert export(checkpoint("full_tp2"), tmp_path / "c", "--tokenizer",
                  str(tmp_path / "none.model")) == 2
    _one_error_line(capsys, "none.model")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert not (tmp_path / "c").exists() and not list(tmp_path.glob(".*tmp*"))


def test_fold_refuses_a_nonlinear_bottleneck(checkpoint, tmp_path, capsys):
    assert export(checkpoint("naive_tp2"), tmp_path / "hf", "--fold") == 2
    _one_error_line(capsys, "σ = 'silu'")
    assert not (tmp_path / "hf").exists()


def test_import_bad_inputs(tmp_path, capsys, tokenizer_model):
    assert import_(tmp_path / "nothing", tmp_path / "a") == 2
    _one_error_line(capsys, "config.json")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert import_(gpt2, tmp_path / "a") == 2
    _one_error_line(capsys, "gpt2", "not LLaMA-like")
    hf = random_llama(tmp_path / "llama")  # k, v: [32, 64]
    capsys.readouterr()  # save_pretrained's progress bar
    assert import_(hf, tmp_path / "a", "model.attn_rank=48") == 2
    _one_error_line(capsys, "rank 48", "min(in, out) = 32", "model.attn_rank <= 32")
    assert import_(hf, tmp_path / "a", f"data.tokenizer_model={tokenizer_model}") == 2
    _one_error_line(capsys, "vocab mismatch", "256", "400")
    (tmp_path / "exists").mkdir()
    assert import_(hf, tmp_path / "exists") == 2
    _one_error_line(capsys, "already exists")
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob(".*tmp*"))


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_export_files_follow_the_umask(tmp_path, umask):
    """Every file of an HF directory gets the mode open() gives under the user's umask
    (safetensors' writer alone makes model.safetensors 0600), sharded or not, CoLA code
    included."""
    from transformers import LlamaConfig

    from megatron_boost.convert.hf_dir import write_hf_dir

    config = LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, vocab_size=16)
    config.auto_map = {"AutoConfig": "configuration_cola.ColaConfig"}  # copies the CoLA code
    state = {f"w{i}": torch.zeros(64) for i in range(3)}
    saved = os.umask(umask)
    try:
        for out, shard in ((tmp_path / "one", "5GB"), (tmp_path / "sharded", 300)):
            out.mkdir()
            write_hf_dir(out, state, config, None, shard)
            modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
            assert "modeling_cola.py" in modes and any("safetensors" in n for n in modes)
            assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
        assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    finally:
        os.umask(saved)


# ---------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------


def test_continuation_keeps_the_space_of_a_word_after_the_prompt(tokenizer_model):
    """A prompt ending in a word, continued by "▁word": the continuation keeps its space with
    the training tokenizer's HF form (what tools/generate.py decodes with) and SentencePiece's
    own decoder."""
    import sentencepiece as spm

    from megatron_boost.convert.generation import continuation_text
    from megatron_boost.convert.tokenizer import _from_sentencepiece

    sp = spm.SentencePieceProcessor(model_file=tokenizer_model)
    hf = _from_sentencepiece(tokenizer_model)
    for decode in (sp.decode, hf.decode):
        whole = sp.encode("the model and the tokenizer")
        prompt = sp.encode("the model and")
        new = whole[len(prompt):]
        assert whole[:len(prompt)] == prompt and sp.id_to_piece(new[0]).startswith("▁")
        assert not decode(new).startswith(" ")  # the loss this guards against
        assert continuation_text(decode, prompt, new) == " the tokenizer"
        # "ü" as two byte-fallback pieces, split between prompt and continuation: the prompt
        # decodes to "a \ufffd", the whole to "a ü"; the continuation is the whole character
        ids = sp.encode("a ü")
        assert [sp.id_to_piece(i) for i in ids[-2:]] == ["<0xC3>", "<0xBC>"]
        assert continuation_text(decode, ids[:-1], ids[-1:]) == "ü"


def test_generate_greedy_equals_hf_generate(checkpoint, tmp_path, capsys):
    from transformers import AutoTokenizer

    from megatron_boost.cli.generate import generate, parse_args
    from megatron_boost.convert.hf_dir import load_hf_model

    ckpt = checkpoint("boost_tp2_pp2")
    assert export(ckpt, tmp_path / "hf") == 0
    new = generate(parse_args([ckpt, "--prompt", "The model", "--max-new-tokens", "12"]))
    assert "[megatron boost] The model" in capsys.readouterr().out
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
    prompt = torch.tensor([tok.encode("The model")])
    hf_new = load_hf_model(tmp_path / "hf").generate(
        prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert new == hf_new[:len(new)] and len(new) > 0


def test_evaluate_perplexity_is_exp_of_the_mean_loss(checkpoint, tmp_path, capsys):
    import math

    import torch.nn.functional as F

    from megatron_boost.cli.evaluate import evaluate, parse_args
    from megatron_boost.convert.tokenizer import hf_tokenizer

    ckpt = checkpoint("naive_tp2")
    text = sample_text()[:1500]
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": text}) + "\n")
    result = evaluate(parse_args([ckpt, "--input", str(tmp_path / "t.jsonl")]))
    path = mb.resolve_checkpoint(ckpt)
    cfg, _ = mb.saved_run_config(path)
    ids = hf_tokenizer(cfg.data).encode(text)
    losses = []
    with mb.single_process():
        model = mb.build_single_model(cfg, mb.saved_vocab_rows(path))
        mb.load_weights(model, path)
        for i in range(0, len(ids), 32):
            w = torch.tensor([ids[i:i + 32]])
            if w.shape[1] > 1:
                logits = mb.logits(model, w)[0]
                losses.append(F.cross_entropy(logits[:-1], w[0, 1:], reduction="none"))
    mean = float(torch.cat(losses).mean())
    assert result["perplexity"] == pytest.approx(math.exp(mean), rel=1e-6)
    assert "perplexity" in capsys.readouterr().out


#: The HF LLaMA at full rank in boost mode: every rank = min(in, out) = 64 (4 KV heads), σ and
#: the gate activation of LLaMA's MLP, so the import is exact (docs/design.md §1).
BOOST_AT_FULL_RANK = ["model.attn_rank=64", "model.mlp_rank=64",
                      "model.bottleneck_activation=identity", "model.mlp_gate_activation=true"]


def _printed_loss(stdout: str, name: str) -> float:
    line = next(l for l in stdout.splitlines() if l.startswith(f"[{name}]"))
    return float(line.split("loss ")[1].split(" |")[0])


def test_imported_llama_trains_and_evaluates_alike_in_every_layout(tmp_path, tokenizer_model):
    from megatron_boost.cli.evaluate import evaluate, parse_args
    from megatron_boost.convert.tokenizer import hf_tokenizer
    from megatron_boost.data.datasets import DataConfig

    # 512 rows = the 400 ids padded for TP (megatron's padded rows would hold logit 0 and take
    # probability mass that the HF model, without them, does not give away)
    hf = random_llama(tmp_path / "llama", num_key_value_heads=4, vocab_size=512)
    hf_tokenizer(DataConfig(tokenizer_model=tokenizer_model)).save_pretrained(hf)
    tok = f"data.tokenizer_model={tokenizer_model}"
    assert import_(hf, tmp_path / "ckpt", *BOOST_AT_FULL_RANK, tok) == 0
    ckpt = tmp_path / "ckpt"
    out = train(2, ["parallel.tp=2", *BOOST_AT_FULL_RANK, "model.num_query_groups=4",
                    f"checkpoint.load={ckpt}", "checkpoint.no_load_optim=true",
                    *FROZEN_TRAINING, tok], tmp_path / "run")
    assert f"resumed from {ckpt}/iter_0000000 at iteration 0" in out, out[-2000:]
    text = tmp_path / "t.txt"
    text.write_text(sample_text()[:1500])
    tp2 = _printed_loss(torchrun(2, "tools/evaluate.py", [str(ckpt), "--input", str(text),
                                                          "parallel.tp=2"]),
                        "megatron boost tp=2 pp=1 dp=1")
    one = evaluate(parse_args([str(ckpt), "--input", str(text)]))["loss"]
    source = evaluate(parse_args([str(hf), "--input", str(text)]))["loss"]
    # fp32 sums of ~1000 token losses in other op orders agree to ~1e-6 relative; a wrong
    # shard or layout moves the mean loss by far more than the printed precision (1e-4).
    assert one == pytest.approx(source, rel=1e-5)
    assert abs(tp2 - one) <= 1e-4


def test_import_takes_the_hf_directory_tokenizer_and_writes_the_training_config(
        tmp_path, tokenizer_model, capsys):
    """The config names a tokenizer file that does not exist here (a user's data/...): the
    import uses the HF directory's own tokenizer instead, and writes train.yaml with the HF
    shape, that tokenizer and init_from, and prints the command that trains from it."""
    import yaml

    from megatron_boost.convert.tokenizer import hf_tokenizer
    from megatron_boost.data.datasets import DataConfig

    hf = random_llama(tmp_path / "llama", vocab_size=400)
    hf_tokenizer(DataConfig(tokenizer_model=tokenizer_model)).save_pretrained(str(hf))
    config = tmp_path / "run.yaml"
    config.write_text((ROOT / "configs/debug.yaml").read_text().replace(
        "data:\n  mock: true", "data:\n  mock: false\n  tokenizer_model: data/absent.model\n"
        "  data_path: [data/corpus]"))
    capsys.readouterr()
    from megatron_boost.cli.import_hf import main

    assert main([str(hf), str(tmp_path / "imported"), "--config", str(config),
                 "parallel.tp=2"]) == 0
    out = capsys.readouterr().out
    written = yaml.safe_load((tmp_path / "imported" / "train.yaml").read_text())
    assert written["data"]["tokenizer_model"] == str(hf)
    assert written["data"]["tokenizer_type"] == "huggingface"
    assert written["checkpoint"]["init_from"] == str(tmp_path / "imported")
    assert written["model"]["vocab_size"] == 400 and written["model"]["num_query_groups"] == 2
    assert written["data"]["data_path"] == ["data/corpus"]  # the rest is the config's
    # the README's launcher, run from this directory (the repository root), not bare torchrun
    assert (f"  scripts/run_local.sh 2 {tmp_path / 'imported' / 'train.yaml'}\n") in out
    # the run directory lies beside the import (not runs/<name> under the current directory)
    # and the output says where; --run-dir chooses another
    assert written["logging"]["run_dir"] == str(tmp_path / "imported-run")
    assert f"run directory {tmp_path / 'imported-run'}" in out
    assert main([str(hf), str(tmp_path / "again"), "--config", str(config), "--run-dir",
                 str(tmp_path / "mine")]) == 0
    written = yaml.safe_load((tmp_path / "again" / "train.yaml").read_text())
    assert written["logging"]["run_dir"] == str(tmp_path / "mine")


# ---------------------------------------------------------------------------------------------
# import -> train (checkpoint.init_from) -> kill -> relaunch resumes
# ---------------------------------------------------------------------------------------------


def _launch(args, run_dir):
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    # Its own process group: the kill takes its helper processes too (dist_checkpointing's).
    return subprocess.Popen([sys.executable, str(ROOT / "pretrain_lowrank.py"), *args,
                             f"logging.run_dir={run_dir}"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _kill_after_first_save(proc, save_dir: Path, timeout_s: float = 300) -> int:
    """SIGKILL ``proc`` (a node failure: no save on the way out) once its tracker names a
    checkpoint; returns that iteration."""
    import time

    tracker = save_dir / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + timeout_s
    while not (tracker.is_file() and tracker.read_text().strip()):
        assert proc.poll() is None, f"the run ended before its first save:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, "no checkpoint saved in time"
        time.sleep(0.05)
    import signal

    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode != 0, "the run finished before it could be killed; raise train_iters"
    return int(tracker.read_text().strip())


def test_init_from_an_import_then_relaunch_resumes(tmp_path):
    """Import writes train.yaml with checkpoint.init_from; the first launch starts from the
    imported weights (lr = 0 keeps them, so the saved weights must equal the import's: a run
    that ignored init_from would hold its own random initialisation), is killed after a save,
    and the same command relaunched resumes at the saved iteration instead of iteration 0."""
    hf = random_llama(tmp_path / "llama")
    assert import_(hf, tmp_path / "imported") == 0
    config = tmp_path / "imported" / "train.yaml"
    assert f"init_from: {tmp_path / 'imported'}" in config.read_text()
    run_dir = tmp_path / "run"
    args = ["--config", str(config), "training.train_iters=400", "checkpoint.save_interval=2",
            "optimizer.lr=0", "optimizer.min_lr=0"]
    first = _launch(args, run_dir)
    saved = _kill_after_first_save(first, run_dir / "checkpoints")
    assert saved >= 2
    imported, trained = ([], [])
    for source, into in ((tmp_path / "imported", imported), (run_dir / "checkpoints", trained)):
        path = mb.resolve_checkpoint(str(source))
        cfg, _ = mb.saved_run_config(path)
        with mb.single_process():
            model = mb.build_single_model(cfg, mb.saved_vocab_rows(path))
            mb.load_weights(model, path)
            into.append({k: v.detach().clone() for k, v in mb.global_weights(model).items()})
    for key, tensor in imported[0].items():
        assert torch.equal(trained[0][key], tensor), key
    # the relaunch's subject is what it resumes, not being a process: the rank pool runs it
    from tests.test_training import run_training

    second = run_training(1, ["training.train_iters=" + str(saved + 2), *args[3:],
                              f"logging.run_dir={run_dir}"], config=str(config), timeout=300)
    out = second.stdout + second.stderr
    assert f"resumed from {run_dir / 'checkpoints'}" in out and f"at iteration {saved} " in out, \
        out[-3000:]
    assert "initialised from" not in out


def test_an_exports_tokenizer_is_a_stock_one(checkpoint, tmp_path):
    """The export's tokenizer is a stock transformers class over a tokenizer.json: it loads
    without running the export's code, as PreTrainedTokenizerFast or as AutoTokenizer with
    trust_remote_code=False (transformers' AutoTokenizer also reads config.json, whose CoLA
    class is the export's own code, and asks about it unless told: README, section 5), and
    gives the training tokenizer's ids."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from megatron_boost.data.datasets import build_tokenizer

    ckpt = checkpoint("boost_tp2_pp2")
    assert export(ckpt, tmp_path / "hf") == 0
    hf = tmp_path / "hf"
    tokenizer_config = json.loads((hf / "tokenizer_config.json").read_text())
    assert "auto_map" not in tokenizer_config and (hf / "tokenizer.json").is_file()
    cfg, _ = mb.saved_run_config(mb.resolve_checkpoint(ckpt))
    text = sample_text()[:2000] + "\n  two  spaces and\ttabs "
    expected = list(build_tokenizer(cfg.data).tokenize(text))
    for tok in (PreTrainedTokenizerFast.from_pretrained(str(hf)),
                AutoTokenizer.from_pretrained(str(hf), trust_remote_code=False)):
        assert type(tok).__module__.startswith("transformers."), type(tok)
        assert tok(text)["input_ids"] == expected
