"""bf16 against fp32 with the same weights: the relative error each TP mode adds.

For every mode the run's model is built twice in the same layout (by the one builder,
``train.build.build_run``, driven from ``cli/precision_check.py``), once in fp32 and once in bf16
(megatron's Float16Module, as the trainer runs it), from the same seed; the fp32 weights are
rounded to bf16 first, so both hold identical values and only the arithmetic differs. One batch
of random tokens goes through both; the error is that of the per-token losses [b, s] and of
the loss gradient with respect to the input embeddings' output (the whole backward pass),
relative in the L2 norm to the fp32 values.
"""

from __future__ import annotations

import torch

__all__ = ["round_to_bf16_", "losses_and_grad", "relative_error"]


def round_to_bf16_(model) -> None:
    """Round the fp32 model's weights to bf16 values in place, so that it holds exactly the
    bf16 model's weights and only the arithmetic differs."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def losses_and_grad(model, tokens: torch.Tensor):
    """Per-token losses [b, s] (fp32) and the gradient reaching the embedding output."""
    b, s = tokens.shape
    captured = {}
    embedding = model.module.embedding if hasattr(model, "module") else model.embedding

    def store(g):
        captured["grad"] = g.float()

    def keep_grad(module, args, out):
        out.register_hook(store)

    handle = embedding.register_forward_hook(keep_grad)
    position_ids = torch.arange(s).expand(b, s)
    losses = model(tokens[:, :-1], position_ids[:, :-1], None, labels=tokens[:, 1:]).float()
    losses.mean().backward()
    handle.remove()
    return losses.detach(), captured["grad"]


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got − ref|| / ||ref|| (L2)."""
    return float((got - ref).norm() / ref.norm())
