"""A language model to score or sample from: a megatron-boost checkpoint (any layout, resharded
to TP = PP = 1 in this process) or an HF directory, behind one next-token interface."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from megatron_boost.convert import megatron_side as mb

__all__ = ["open_model"]


class _Model:
    def __init__(self, logits_fn, tokenizer, seq_length: int, name: str):
        self.logits, self.tokenizer, self.seq_length, self.name = (logits_fn, tokenizer,
                                                                   seq_length, name)


@contextlib.contextmanager
def open_model(path: str) -> Iterator[_Model]:
    """``logits([b, s] ids) -> [b, s, V]``, ``tokenizer`` (``encode``/``decode``), the context
    length and a name, for a checkpoint folder or an HF directory."""
    if (Path(path) / "config.json").is_file():
        from transformers import AutoTokenizer

        from megatron_boost.convert.hf_dir import load_hf_model

        model = load_hf_model(path)
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
        with torch.no_grad():
            yield _Model(lambda t: model(t).logits.float(), tok,
                         model.config.max_position_embeddings, type(model).__name__)
        return
    ckpt = mb.resolve_checkpoint(path)
    cfg, _ = mb.saved_run_config(ckpt)
    if not cfg.data.tokenizer_model:
        raise ValueError(f"{ckpt} was trained without a tokenizer (mock data); text needs one")
    with mb.single_process(cfg.training.seed):
        model = mb.build_single_model(cfg, mb.saved_vocab_rows(ckpt))
        mb.load_weights(model, ckpt)
        from megatron_boost.convert.tokenizer import hf_tokenizer

        yield _Model(lambda t: mb.logits(model, t), hf_tokenizer(cfg.data),
                     cfg.model.seq_length, f"megatron {cfg.parallel.mode}")
