"""bf16 against fp32 with the same weights: the relative error each TP mode adds.

For every mode the run's model is built twice in the same layout, once in fp32 and once in bf16
(megatron's Float16Module, as the trainer runs it), from the same seed; the fp32 weights are
rounded to bf16 first, so both hold identical values and only the arithmetic differs. One batch
of random tokens goes through both; the error is that of the per-token losses [b, s] and of
the loss gradient with respect to the input embeddings' output (the whole backward pass),
relative in the L2 norm to the fp32 values.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

__all__ = ["bf16_error_worker"]


def _build(cfg, dtype: torch.dtype, vocab: int):
    from megatron.core.transformer.module import Float16Module

    from megatron_boost.config.run import to_transformer_config
    from megatron_boost.model.gpt import build_model
    from megatron_boost.model.init import init_global_weights

    config = to_transformer_config(cfg, dtype)
    (model,) = build_model(config, vocab, cfg.model.seq_length)
    init_global_weights([model], cfg.training.seed, config)
    if dtype == torch.bfloat16:
        return Float16Module(config, model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # the bf16 model's exact weights
    return model


def _losses_and_grad(model, tokens: torch.Tensor):
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


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


def bf16_error_worker(rank: int, world: int, config_path: str, overrides: Sequence[str],
                      modes: Sequence[str]) -> List[Dict[str, float]]:
    """In each of ``world`` = tp gloo processes: per mode, the relative bf16 errors of the
    losses and of the embedding-output gradient (rank 0's view; every TP rank holds the
    same losses)."""
    from megatron_boost.config.run import load_run_config
    from megatron_boost.model.gpt import padded_vocab_size
    from megatron_boost.train.step import initialize_parallel

    base = load_run_config(config_path, [*overrides, f"parallel.tp={world}"])
    initialize_parallel(world, 1, None, base.training.seed)
    vocab = padded_vocab_size(base.model.vocab_size, world)
    gen = torch.Generator().manual_seed(base.training.seed)
    tokens = torch.randint(0, base.model.vocab_size, (base.training.micro_batch_size,
                                                     base.model.seq_length + 1), generator=gen)
    rows = []
    for mode in modes:
        cfg = load_run_config(config_path, [*overrides, f"parallel.tp={world}",
                                            f"parallel.mode={mode}"])
        ref_loss, ref_grad = _losses_and_grad(_build(cfg, torch.float32, vocab), tokens)
        loss, grad = _losses_and_grad(_build(cfg, torch.bfloat16, vocab), tokens)
        rows.append({"mode": mode, "loss_rel_err": _relative(loss, ref_loss),
                     "grad_rel_err": _relative(grad, ref_grad)})
    return rows
