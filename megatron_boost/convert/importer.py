"""Hugging Face LLaMA-architecture directory -> megatron-boost checkpoint (any mode, any layout).

The model shape comes from the HF config; the mode, ranks, σ and the rest from the run config.
Full rank imports the weights as they are; low rank initialises every projection by truncated
SVD, W ≈ B·A with B = U·√S and A = √S·Vᵀ (the best rank-r approximation, Eckart-Young), whose
relative Frobenius error is sqrt(Σ_{i>r} s_i² / Σ s_i²) (printed per layer). A ``ColaForCausalLM``
(our own export) imports its factors as they are, bit-exactly. The checkpoint is written by the
trainer's save code at TP = 1 and reshards on load. Beside it, ``<OUTPUT>/train.yaml`` is a run
configuration with the imported shape, the HF directory's own tokenizer (by default) and
``checkpoint.init_from=<OUTPUT>``: training starts from the imported weights once, and every
relaunch resumes from the run's own checkpoints.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import yaml

from megatron_boost.convert import megatron_side as mb
from megatron_boost.convert.export import attention_shape, prompt_ids
from megatron_boost.convert.hf_dir import (HF_ACTIVATIONS, load_hf_model, read_config_json,
                                           read_hf_state_dict)
from megatron_boost.convert.mapping import PROJECTIONS, hf_to_megatron

__all__ = ["import_hf", "svd_factors", "read_hf_config", "SAMPLE_TEXT"]

SAMPLE_TEXT = ("The quick brown fox jumps over the lazy dog. To be, or not to be, that is the "
               "question: whether 'tis nobler in the mind to suffer the slings and arrows of "
               "outrageous fortune, or to take arms against a sea of troubles.")
_SIGMA_OF_HF = {hf: ours for ours, hf in HF_ACTIVATIONS.items()}


def read_hf_config(hf_dir: Path) -> dict:
    """config.json of a LLaMA-like model (checked), as a dict."""
    path = hf_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"'{hf_dir}' has no config.json; give a local Hugging Face model "
                         f"directory")
    hf = read_config_json(hf_dir)
    kind = hf.get("model_type")
    if kind not in ("llama", "cola"):
        raise ValueError(f"model_type {kind!r} of '{hf_dir}' is not LLaMA-like; import_hf "
                         f"reads llama (LlamaForCausalLM) and cola (our ColaForCausalLM)")
    rope = hf.get("rope_parameters") or {"rope_type": "default"}
    for key, bad in (("attention_bias", True), ("mlp_bias", True)):
        if hf.get(key) is bad:
            raise ValueError(f"'{hf_dir}' has {key}: true; megatron-boost models have no biases")
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"'{hf_dir}' uses rope_type {rope.get('rope_type')!r}; only plain "
                         f"RoPE (default) is supported")
    if kind == "cola" and hf.get("lr_act_type") not in _SIGMA_OF_HF:
        raise ValueError(f"'{hf_dir}' has lr_act_type {hf.get('lr_act_type')!r}; the bottleneck "
                         f"activations known are {', '.join(_SIGMA_OF_HF)} (transformers' "
                         f"names of megatron-boost's {', '.join(HF_ACTIVATIONS)})")
    if kind == "llama" and hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"'{hf_dir}' has hidden_act {hf.get('hidden_act')!r}; LLaMA's MLP "
                         f"(SwiGLU, silu) is the only one supported")
    return hf


def _shape_overrides(hf: dict) -> List[str]:
    """Run-config overrides that give the megatron model the HF model's shape."""
    heads = hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}
    values = {
        "num_layers": hf["num_hidden_layers"], "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"], "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads,
        "norm_epsilon": hf.get("rms_norm_eps", 1e-6),
        "rotary_base": int(rope.get("rope_theta", hf.get("rope_theta", 10000))),
        "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False)),
    }
    if hf["model_type"] == "cola":
        values.update(attn_rank=hf["attn_rank"], mlp_rank=hf["mlp_rank"],
                      bottleneck_activation=_SIGMA_OF_HF[hf["lr_act_type"]],
                      mlp_gate_activation=_gate_activation(hf))
    return [f"model.{k}={v}" for k, v in values.items()]


def _gate_activation(hf: dict) -> bool:
    """Whether a CoLA config.json's MLP gate has its SiLU: ``only_lr_act`` false (CoLA's key,
    which exports write since the keys follow CoLA's meaning); before that, the gate's
    activation was ``hidden_act`` ("silu" or "linear")."""
    if "only_lr_act" in hf:
        gate = hf.get("mlp_gate_act") or hf.get("hidden_act")
        if not hf["only_lr_act"] and gate != "silu":
            raise ValueError(f"the MLP gate's activation is {gate!r}; megatron-boost's gate "
                             f"activation is SiLU (model.mlp_gate_activation) or none")
        return not hf["only_lr_act"]
    return hf.get("hidden_act") == "silu"


def svd_factors(w: torch.Tensor, rank: int) -> Tuple[torch.Tensor, torch.Tensor, float]:
    """(A [r, in], B [out, r], relative error) of the rank-r truncated SVD of W [out, in]."""
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    root = s[:rank].sqrt()
    b = u[:, :rank] * root  # [out, r]
    a = root[:, None] * vh[:rank]  # [r, in]
    error = math.sqrt(float((s[rank:] ** 2).sum() / (s ** 2).sum()))
    return a.to(w.dtype), b.to(w.dtype), error


def _factor_source(cfg, hf: dict, state: Dict[str, torch.Tensor], errors: dict):
    """The ``factors(layer, proj, hf_module)`` callback of mapping.hf_to_megatron."""
    attn_rank, mlp_rank = cfg.model.resolved_ranks()

    def factors(layer: int, proj: str, hf_module: str):
        rank = attn_rank if proj in ("q", "k", "v", "o") else mlp_rank
        if hf["model_type"] == "cola":
            return state[f"{hf_module}.cola_a"].t(), state[f"{hf_module}.cola_b"].t()
        a, b, errors[(layer, proj)] = svd_factors(state[f"{hf_module}.weight"], rank)
        return a, b

    return factors


def _check_ranks(cfg) -> None:
    """A truncated SVD keeps at most min(in, out) directions of each [out, in] weight."""
    m = cfg.model
    head_dim = m.kv_channels or m.hidden_size // m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    limits = {"attn_rank": ("k/v", min(m.hidden_size, groups * head_dim,
                                       m.num_attention_heads * head_dim)),
              "mlp_rank": ("gate/up/down", min(m.hidden_size, m.ffn_hidden_size))}
    for name, rank in zip(("attn_rank", "mlp_rank"), m.resolved_ranks()):
        proj, limit = limits[name]
        if rank > limit:
            raise ValueError(f"rank {rank} (model.{name}) exceeds min(in, out) = {limit} of "
                             f"the {proj} projections; set model.{name} <= {limit}")


def _pad_vocab(weights: Dict[str, torch.Tensor], rows: int) -> None:
    """Zero rows for megatron's padded vocabulary ids (never produced by the tokenizer)."""
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if key not in weights:  # a tied model has no output layer of its own
            continue
        w = weights[key]
        weights[key] = torch.cat([w, w.new_zeros(rows - w.shape[0], w.shape[1])], 0)


def _error_table(errors: dict, num_layers: int) -> str:
    names = list(PROJECTIONS)
    lines = ["relative error ||W - B·A||_F / ||W||_F per layer and projection:",
             "layer " + " ".join(f"{n:>7}" for n in names)]
    for layer in range(num_layers):
        lines.append(f"{layer:>5} " + " ".join(f"{errors[(layer, n)]:7.4f}" for n in names))
    return "\n".join(lines)


def _sample_tokens(hf_dir: Path, cfg, text: str, vocab: int) -> List[int]:
    """The sample text in the HF directory's tokenizer, else the run's, else fixed ids."""
    if any((hf_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(str(hf_dir), trust_remote_code=True)(text)["input_ids"]
    elif cfg.data.tokenizer_model:
        ids = list(mb.build_tokenizer(cfg.data).tokenize(text))
    else:
        ids = prompt_ids(None, vocab, cfg.model.seq_length)
    return ids[: cfg.model.seq_length]


def _perplexities(model, hf_model, tokens: List[int]) -> Tuple[float, float]:
    from megatron_boost.convert.scoring import perplexity, summed_loss

    t = torch.tensor([tokens])
    with torch.no_grad():
        source = summed_loss(hf_model(t).logits[0], t[0])
    ours = summed_loss(mb.logits(model, t)[0], t[0])
    return perplexity(source, len(tokens) - 1), perplexity(ours, len(tokens) - 1)


_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _tokenizer_overrides(hf_dir: Path, overrides: Sequence[str]) -> List[str]:
    """The HF directory's own tokenizer, unless the command line names one: the imported model
    keeps the ids it was trained with (the config's tokenizer file is not needed)."""
    named = any(o.startswith("data.tokenizer_model=") for o in overrides)
    if named or not any((hf_dir / f).is_file() for f in _HF_TOKENIZER_FILES):
        return []
    return ["data.tokenizer_type=huggingface", f"data.tokenizer_model={hf_dir}"]


#: checkpoint keys train.yaml sets itself (init_from: the import; load, save: the run's own).
_CHECKPOINT_KEYS_SET = ("checkpoint.init_from", "checkpoint.load", "checkpoint.save")


def _same_value(a: str, b: str) -> bool:
    """Two override values equal as YAML scalars, numbers by value (YAML 1.1 reads 1e-6, without
    a dot, as a string)."""
    a, b = yaml.safe_load(a), yaml.safe_load(b)
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return a == b


def _check_no_ignored_override(hf: dict, overrides: Sequence[str]) -> None:
    """A command-line setting the import would replace is an error, not silently dropped: the
    model's shape comes from the HF directory, and train.yaml sets the checkpoint keys."""
    taken = dict(item.split("=", 1) for item in _shape_overrides(hf))
    taken["model.vocab_size"] = str(hf["vocab_size"])
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.strip()
        if key in taken and not _same_value(value, taken[key]):
            raise ValueError(f"override '{item}': the import takes {key} from the HF model "
                             f"({taken[key]}); remove the override (change the shape after "
                             f"the import by training a new model)")
        if key in _CHECKPOINT_KEYS_SET:
            raise ValueError(f"override '{item}' would be ignored: train.yaml starts from the "
                             f"import (checkpoint.init_from) and saves under its run "
                             f"directory; give {key} when training, or --run-dir here")


def _run_config(hf: dict, hf_dir: Path, config: Optional[str], overrides: Sequence[str]):
    _check_no_ignored_override(hf, overrides)
    cfg = mb.load_run_config(config, [*_tokenizer_overrides(hf_dir, overrides), *overrides,
                                      *_shape_overrides(hf),
                                      f"model.vocab_size={hf['vocab_size']}"])
    if hf["model_type"] == "cola" and not mb.is_lowrank(cfg):
        raise ValueError("a ColaForCausalLM imports into a low-rank mode (parallel.mode naive "
                         "or boost); set parallel.mode=boost")
    vocab = (int(mb.build_tokenizer(cfg.data).vocab_size) if cfg.data.tokenizer_model
             else hf["vocab_size"])
    if hf["model_type"] == "llama" and mb.is_lowrank(cfg):
        _check_ranks(cfg)
    rows = mb.padded_vocab_size(vocab, cfg.parallel.tp)
    if not vocab <= hf["vocab_size"] <= rows:
        raise ValueError(f"vocab mismatch: the HF model has {hf['vocab_size']} embedding rows, "
                         f"the run's tokenizer {vocab} ids (padded to {rows}); the rows must "
                         f"lie in [{vocab}, {rows}]: use the model's own tokenizer")
    return cfg, rows


def _run_dir(out: Path, run_dir: Optional[str], overrides: Sequence[str]) -> str:
    """The training run's directory: ``run_dir`` (``--run-dir``), else a ``logging.run_dir``
    override, else ``<output>-run`` beside the import (the config file's own run directory
    belongs to the run it came from: training there would resume that run)."""
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("logging.run_dir=")]
    return run_dir or (given[-1] if given else str(out.parent / f"{out.name}-run"))


def import_hf(hf_dir: str, output: str, config: Optional[str], overrides: Sequence[str] = (),
              sample_text: Optional[str] = None, run_dir: Optional[str] = None) -> dict:
    """Import; prints the error table and both perplexities, returns them with the path."""
    src, out = Path(hf_dir), Path(output)
    if out.exists():
        raise ValueError(f"output directory '{out}' already exists; remove it or choose "
                         f"another path (nothing is overwritten)")
    hf = read_hf_config(src)
    cfg, rows = _run_config(hf, src, config, overrides)
    hf_model = load_hf_model(src)
    state, errors = read_hf_state_dict(hf_model), {}
    factors = _factor_source(cfg, hf, state, errors) if mb.is_lowrank(cfg) else None
    weights = hf_to_megatron(state, cfg.model.num_layers, attention_shape(cfg), factors)
    if rows > hf["vocab_size"]:
        # megatron's softmax runs over every padded row; a zero row has logit 0 and takes some
        # probability mass until training pushes it down, so the imported perplexity is higher.
        print(f"note: the vocabulary ({hf['vocab_size']} rows) is padded to {rows} rows for "
              f"megatron (a multiple of 128 and of TP); the {rows - hf['vocab_size']} zero rows "
              f"have logit 0, which raises the imported model's loss until training lowers them",
              flush=True)
    _pad_vocab(weights, rows)
    if errors:
        print(_error_table(errors, cfg.model.num_layers), flush=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    with mb.single_process(cfg.training.seed):
        model = mb.build_single_model(cfg, rows)
        mb.set_weights(model, weights)
        tokens = _sample_tokens(src, cfg, sample_text or SAMPLE_TEXT, hf["vocab_size"])
        ppl_source, ppl_ours = _perplexities(model, hf_model, tokens)
        print(f"perplexity on the sample text ({len(tokens)} tokens): source {ppl_source:.4f}"
              f" | imported ({cfg.parallel.mode}) {ppl_ours:.4f}", flush=True)
        try:
            mb.save_weights_as_checkpoint(cfg, weights, rows, str(tmp))
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    run_yaml = write_training_config(cfg, out, _run_dir(out, run_dir, overrides))
    return {"errors": errors, "ppl_source": ppl_source, "ppl_imported": ppl_ours,
            "checkpoint": str(out), "config": str(run_yaml),
            "run_dir": _run_dir(out, run_dir, overrides),
            "command": training_command(cfg, run_yaml)}


def write_training_config(cfg, out: Path, run_dir: str) -> Path:
    """``<out>/train.yaml``: the run configuration with the imported shape (model dims, ranks,
    tokenizer), ``checkpoint.init_from=<out>`` and ``logging.run_dir=run_dir``, so a training
    run starts from the imported weights once and resumes from its own checkpoints on every
    relaunch."""
    cfg = copy.deepcopy(cfg)
    cfg.checkpoint.init_from, cfg.checkpoint.load, cfg.checkpoint.save = str(out), None, None
    cfg.logging.run_dir = run_dir
    path = out / "train.yaml"
    path.write_text(f"# Written by tools/import_hf.py: the imported model's shape; training "
                    f"starts from the weights in {out}\n"
                    + yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    return path


def training_command(cfg, run_yaml: Path) -> str:
    """The command that trains the imported model through the project's launcher (its layout's
    process count; the data prefix stays a placeholder when the configuration names none)."""
    procs = cfg.parallel.tp * cfg.parallel.pp
    data = "" if cfg.data.data_path or cfg.data.mock else " 'data.data_path=[PREFIX]'"
    return f"{_launcher(procs, run_yaml)}{data}"


def _launcher(procs: int, run_yaml: Path) -> str:
    """The launcher as the README runs it (validation first, one error line, Ctrl-C saves):
    ``scripts/run_local.sh`` of the repository, named as the printed command must name it from
    this directory (relative when shorter), else the installed ``megatron-boost-train``."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "run_local.sh"
    if not script.is_file():
        return f"megatron-boost-train --nproc-per-node {procs} --config {run_yaml}"
    relative = os.path.relpath(script)
    return f"{relative if len(relative) <= len(str(script)) else script} {procs} {run_yaml}"
