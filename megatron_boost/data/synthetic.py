"""Synthetic micro-batches of random tokens: the benchmark's and the equivalence checks' data.

One global batch of ``global_batch_size`` sequences of ``seq_length + 1`` tokens is drawn from
a seeded generator in one call; a data-parallel rank takes its contiguous share of sequences and
cuts it into micro-batches. Inputs are tokens[:, :-1] and labels tokens[:, 1:] (next-token
prediction), every position counts in the loss, and position ids are 0..s-1.
"""

from __future__ import annotations

from typing import Dict, List

import torch

__all__ = ["synthetic_microbatches"]


def synthetic_microbatches(vocab: int, seq_length: int, micro_batch_size: int,
                           global_batch_size: int, seed: int, dp: int = 1,
                           dp_rank: int = 0) -> List[Dict[str, torch.Tensor]]:
    """The micro-batches of data-parallel rank ``dp_rank`` of ``dp``: dicts of tokens,
    labels, loss_mask and position_ids, each [micro_batch_size, seq_length]."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (global_batch_size, seq_length + 1), generator=g)
    per_dp = global_batch_size // dp
    mine = tokens[dp_rank * per_dp:(dp_rank + 1) * per_dp]  # [gbs/dp, s+1]
    micro = []
    for i in range(0, per_dp, micro_batch_size):
        t = mine[i:i + micro_batch_size]  # [b, s+1]
        micro.append({
            "tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous(),
            "loss_mask": torch.ones(t.shape[0], seq_length),
            "position_ids": torch.arange(seq_length).expand(t.shape[0], -1).contiguous(),
        })
    return micro
