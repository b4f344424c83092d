"""Language-model scores shared by import_hf and evaluate: summed next-token loss, perplexity
exp(mean loss) and bits per byte (total loss in nats / ln 2 / UTF-8 bytes of the text)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["summed_loss", "perplexity", "bits_per_byte"]


def summed_loss(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """Σ -log p(token_{t+1} | ..t) over one sequence: logits [s, V], tokens [s]."""
    return float(F.cross_entropy(logits[:-1].float(), tokens[1:], reduction="sum"))


def perplexity(total_loss: float, n_tokens: int) -> float:
    return math.exp(total_loss / n_tokens)


def bits_per_byte(total_loss: float, n_bytes: int) -> float:
    return total_loss / math.log(2) / n_bytes
