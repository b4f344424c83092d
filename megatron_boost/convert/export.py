"""Checkpoint (any mode and layout) -> Hugging Face directory, checked before it is written.

The checkpoint's saved run config is rebuilt at TP = PP = 1 in one process, only the model's
sharded state is loaded (dist_checkpointing reshards any layout, regular or distributed
optimizer, ``docs/design.md §8``), and the global tensors are renamed (``mapping.py``).
Low-rank models become ``ColaForCausalLM`` with their modeling code; full-rank models, and
low-rank models with σ = identity under ``fold``, become plain ``LlamaForCausalLM``.
Vocabulary padding is kept: the HF embedding and head have megatron's padded row count, so
every logit (and the softmax over them) equals megatron's; the tokenizer never emits the
padded ids.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import List, Optional

import torch

from megatron_boost.convert import megatron_side as mb
from megatron_boost.convert.generation import sample
from megatron_boost.convert.hf_dir import (HF_ACTIVATIONS, cola_reads_it_differently, hf_config,
                                          load_hf_model, write_hf_dir)
from megatron_boost.convert.mapping import AttentionShape, megatron_to_hf

__all__ = ["export_checkpoint", "compare_with_hf", "attention_shape", "VERIFY_PROMPT"]

VERIFY_PROMPT = "To be, or not to be, that is the question:"
#: fp32 logits of the same function computed in another op order (online RMSNorm, fused vs
#: split projections, SDPA vs megatron's softmax) differ by ~1e-6; a wrong mapping by O(1).
LOGIT_TOLERANCE = 1e-3
_NEW_TOKENS = 8


def attention_shape(cfg) -> AttentionShape:
    m = cfg.model
    return AttentionShape(m.num_attention_heads, m.num_query_groups or m.num_attention_heads,
                          m.kv_channels or m.hidden_size // m.num_attention_heads)


def _check_request(cfg, out: Path, fold: bool) -> None:
    if out.exists():
        raise ValueError(f"output directory '{out}' already exists; remove it or choose "
                         f"another path (nothing is overwritten)")
    sigma = cfg.model.bottleneck_activation
    if fold and not mb.is_lowrank(cfg):
        raise ValueError("--fold applies to low-rank (naive/boost) checkpoints; this one is "
                         "full rank and exports as LlamaForCausalLM without it")
    if fold and sigma != "identity":
        raise ValueError(f"--fold needs bottleneck_activation identity (W = B·A); this model "
                         f"has σ = {sigma!r}, so B·σ(A·x) is not linear: export without --fold")
    if mb.is_lowrank(cfg) and not fold and sigma not in HF_ACTIVATIONS:
        raise ValueError(f"bottleneck_activation {sigma!r} has no transformers equivalent "
                         f"(supported: {sorted(HF_ACTIVATIONS)})")


def _tokenizer(cfg, tokenizer_path: Optional[str]):
    """(HF tokenizer, training tokenizer), or (None, None) for a run without one."""
    from megatron_boost.convert.tokenizer import check_same_ids, hf_tokenizer

    data = cfg.data
    if tokenizer_path:
        data.tokenizer_model = tokenizer_path
    if not data.tokenizer_model:
        return None, None
    if not os.path.exists(data.tokenizer_model):
        raise ValueError(f"tokenizer '{data.tokenizer_model}' (from the run config) does not "
                         f"exist; pass --tokenizer PATH to the run's tokenizer file")
    hf_tok = hf_tokenizer(data, "--tokenizer" if tokenizer_path else "data.tokenizer_model")
    ours = mb.build_tokenizer(data)
    check_same_ids(hf_tok, ours, VERIFY_PROMPT + "\n  Leading spaces, ünïcode and\ttabs.")
    return hf_tok, ours


def prompt_ids(tokenizer, vocab: int, length: int) -> List[int]:
    """The verification prompt's ids, or fixed pseudo-random ids without a tokenizer."""
    if tokenizer is not None:
        return list(tokenizer.tokenize(VERIFY_PROMPT))[:length]
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(0)).tolist()


@torch.no_grad()
def compare_with_hf(model, hf_model, prompt: List[int], new_tokens: int = _NEW_TOKENS):
    """(max |Δlogits| on the prompt, greedy continuations agree, megatron's continuation):
    megatron recomputes the prefix per token, HF ``generate`` uses its KV cache."""
    tokens = torch.tensor([prompt])
    ours = mb.logits(model, tokens)[0]
    theirs = hf_model(tokens).logits[0].float()
    delta = float((ours - theirs).abs().max())
    greedy = sample(lambda ids: mb.logits(model, torch.tensor([ids]))[0, -1], prompt,
                    new_tokens)
    hf_greedy = hf_model.generate(tokens, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False)[0, len(prompt):].tolist()
    return delta, greedy == hf_greedy, greedy


def export_checkpoint(checkpoint: str, output: str, fold: bool = False,
                      tokenizer: Optional[str] = None, max_shard_size="5GB") -> str:
    """Export; returns the printed verification line. Writes ``output`` only if it passes."""
    out = Path(output)
    ckpt = mb.resolve_checkpoint(checkpoint)
    cfg, _ = mb.saved_run_config(ckpt)
    _check_request(cfg, out, fold)
    hf_tok, ours = _tokenizer(cfg, tokenizer)
    rows = mb.saved_vocab_rows(ckpt)
    if hf_tok is not None and len(hf_tok) > rows:
        raise ValueError(f"tokenizer has {len(hf_tok)} tokens but the checkpoint's embedding "
                         f"has {rows} rows; pass the run's own tokenizer with --tokenizer")
    with mb.single_process(cfg.training.seed):
        model = mb.build_single_model(cfg, rows)
        mb.load_weights(model, ckpt)
        lowrank = mb.is_lowrank(cfg)
        state = megatron_to_hf({k: v.detach() for k, v in mb.global_weights(model).items()},
                               attention_shape(cfg), lowrank, fold)
        config = hf_config(cfg, rows, cola=lowrank and not fold, tokenizer=hf_tok)
        attn_rank, mlp_rank = cfg.model.resolved_ranks()
        if lowrank and not fold and attn_rank != mlp_rank:
            print(f"note: the CoLA authors' ColaForCausalLM has one rank for every projection; "
                  f"this model's are {attn_rank} (attention) and {mlp_rank} (MLP), which "
                  f"this directory's own class reads (attn_rank, mlp_rank)", flush=True)
        if lowrank and not fold and cola_reads_it_differently(cfg.model):
            print(f"note: the CoLA authors' ColaForCausalLM would apply σ "
                  f"({cfg.model.bottleneck_activation}) to the MLP's gate where this model "
                  f"applies SiLU; transformers' trust_remote_code loads this directory's own "
                  f"class, which reads mlp_gate_act", flush=True)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        tmp.mkdir(parents=True)
        try:
            write_hf_dir(tmp, state, config, hf_tok, max_shard_size)
            line = _verify(model, tmp, prompt_ids(ours, rows, min(16, cfg.model.seq_length
                                                                   - _NEW_TOKENS)))
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return line


def _verify(model, hf_dir: Path, prompt: List[int]) -> str:
    hf_model = load_hf_model(hf_dir)
    delta, agree, _ = compare_with_hf(model, hf_model, prompt)
    line = (f"verification: {type(hf_model).__name__} vs megatron on {len(prompt)} prompt "
            f"tokens: max |Δlogits| = {delta:.3e} (tolerance {LOGIT_TOLERANCE:g}); greedy "
            f"tokens ({_NEW_TOKENS}) {'agree' if agree else 'DIFFER'}")
    print(line, flush=True)
    if delta > LOGIT_TOLERANCE or not agree:
        raise ValueError(f"the exported model does not reproduce the checkpoint ({line}); "
                         f"nothing was written")
    return line
