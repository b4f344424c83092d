"""Next-token loss of a language model on a text, in windows of its context length.

The token ids are cut into consecutive windows of ``seq_length`` tokens (the last one may be
shorter); a window of n tokens scores its tokens 2..n, each from the ones before it, so the
text's loss is the sum of n - 1 token losses per window. An HF model scores a batch of
windows at a time in this process; a megatron-boost checkpoint is scored in the launched
layout (``megatron_side.launched_world``): every global batch of windows is split over the
data-parallel ranks, each rank runs megatron's forward-only schedule over its micro-batches, and
the summed token losses meet in one all-reduce.
"""

from __future__ import annotations

from typing import Callable, Iterable, List

import torch
import torch.distributed as dist

from megatron_boost.convert import megatron_side as mb
from megatron_boost.convert.scoring import summed_loss

__all__ = ["text_windows", "predicted_tokens", "window_batch", "same_length_batches",
           "hf_summed_loss", "layout_summed_loss"]


def text_windows(ids: List[int], seq_length: int) -> List[List[int]]:
    """Consecutive windows of ``seq_length`` ids; a last window of one id predicts nothing and
    is dropped."""
    windows = [ids[i:i + seq_length] for i in range(0, len(ids), seq_length)]
    return [w for w in windows if len(w) > 1]


def predicted_tokens(windows: List[List[int]]) -> int:
    return sum(len(w) - 1 for w in windows)


def window_batch(windows: List[List[int]], seq_length: int) -> dict:
    """A micro-batch of windows padded to ``seq_length``: tokens, labels (the next token),
    loss_mask (1 where a label is a token of the window) and position_ids, all [b, s]. An
    empty window is all padding (mask 0): it fills a micro-batch without changing the sum."""
    b = len(windows)
    tokens = torch.zeros(b, seq_length, dtype=torch.long)  # [b, s]
    loss_mask = torch.zeros(b, seq_length)  # [b, s]
    for row, w in enumerate(windows):
        tokens[row, :len(w)] = torch.tensor(w, dtype=torch.long)
        loss_mask[row, :max(len(w) - 1, 0)] = 1.0
    labels = torch.roll(tokens, -1, dims=1)  # [b, s]: token t + 1 at t (the wrapped one masked)
    position_ids = torch.arange(seq_length).repeat(b, 1)  # [b, s]
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
            "position_ids": position_ids}


def same_length_batches(windows: List[List[int]], batch_size: int) -> List[List[List[int]]]:
    """Consecutive windows in batches of at most ``batch_size``, a batch's windows of one
    length (only the last window may be shorter: it goes alone), so a batch needs no padding."""
    batches: List[List[List[int]]] = []
    for w in windows:
        if batches and len(batches[-1]) < batch_size and len(batches[-1][0]) == len(w):
            batches[-1].append(w)
        else:
            batches.append([w])
    return batches


def hf_summed_loss(logits_fn: Callable, batches: Iterable[List[List[int]]]) -> float:
    """Σ token losses of an HF model (``logits_fn([b, s] ids) -> [b, s, V]``), a batch of
    windows of one length (:func:`same_length_batches`) per forward."""
    total = 0.0
    for batch in batches:
        t = torch.tensor(batch)  # [b, s]
        logits = logits_fn(t)  # [b, s, V]
        total += sum(summed_loss(logits[row], t[row]) for row in range(len(batch)))
    return total


def _rank_microbatches(batch: List[List[int]], cfg) -> List[List[List[int]]]:
    """This data-parallel rank's share of one global batch of windows, in micro-batches; the
    share is padded with empty windows so every rank runs the same schedule."""
    from megatron.core import parallel_state as ps

    t = cfg.training
    share = t.global_batch_size // ps.get_data_parallel_world_size()
    start = ps.get_data_parallel_rank() * share
    mine = batch[start:start + share]
    mine = mine + [[]] * (share - len(mine))
    return [mine[i:i + t.micro_batch_size] for i in range(0, share, t.micro_batch_size)]


def layout_summed_loss(chunks: List, windows: List[List[int]], cfg, device,
                       progress: Callable[[Iterable], Iterable] = iter) -> float:
    """Σ token losses of the windows under this rank's model chunks (every rank of the launch
    calls it with the same windows and gets the same total). ``progress`` wraps the loop over
    global batches (a progress bar on rank 0)."""
    gbs, seq = cfg.training.global_batch_size, cfg.model.seq_length
    local = 0.0
    for start in progress(range(0, len(windows), gbs)):
        batches = [window_batch(mb_windows, seq)
                   for mb_windows in _rank_microbatches(windows[start:start + gbs], cfg)]
        means = mb.forward_only_losses(chunks, [{k: v.to(device) for k, v in b.items()}
                                                for b in batches],
                                       seq, cfg.training.micro_batch_size)
        # the step reports each micro-batch's mean over its unmasked tokens
        local += sum(mean * float(b["loss_mask"].sum()) for mean, b in zip(means, batches))
    total = torch.tensor([local if mb.holds_the_loss() else 0.0], dtype=torch.float64,
                         device=device)
    dist.all_reduce(total)  # one value per data-parallel replica
    return float(total)
