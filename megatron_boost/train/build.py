"""The one builder of a run: model chunks, optimizer, scheduler, forward step and schedule
runner, from a :class:`~megatron_boost.config.resolved.ResolvedRun` (docs/design.md §9).

Every entry point builds its model here (the trainer, the benchmark, the precision check, the
conversion tools, evaluation, generation and the equivalence harness), so the padded
vocabulary, the dtype, the rotary base, the seed, the process groups and the layout-independent
initial weights (docs/design.md §8) cannot differ between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_boost.config.resolved import ResolvedRun, to_transformer_config
from megatron_boost.config.transformer import BoostTransformerConfig
from megatron_boost.config.validation import (LR_DECAY_STYLES, lr_decay_iterations,
                                              train_iterations)
from megatron_boost.model.gpt import build_model
from megatron_boost.model.init import build_globally_initialised
from megatron_boost.train.step import (
    build_ddp_model,
    build_optimizer,
    make_forward_step,
    on_run_device,
    run_schedule,
)

__all__ = ["BuiltRun", "build_run", "build_scheduler"]


@dataclass
class BuiltRun:
    """What :func:`build_run` returns."""

    run: ResolvedRun
    config: BoostTransformerConfig
    chunks: List[Any]
    """This rank's model chunks: DDP-wrapped for training, bare modules for inference."""
    optimizer: Any
    """megatron's optimizer (None for inference)."""
    scheduler: Optional[OptimizerParamScheduler]
    """Warmup + cosine schedule of the configuration (None for inference)."""
    forward_step: Callable
    """megatron forward_step_func reading batches with the builder's ``get_batch``."""

    def run_schedule(self, data_iterators, num_microbatches: int, forward_only: bool,
                     forward_step: Optional[Callable] = None):
        """megatron's pipeline schedule over this run's chunks (losses per micro-batch)."""
        cfg = self.run.cfg
        return run_schedule(forward_step or self.forward_step, data_iterators, self.chunks,
                            num_microbatches, cfg.model.seq_length,
                            cfg.training.micro_batch_size, forward_only)


def build_scheduler(optimizer, run: ResolvedRun) -> OptimizerParamScheduler:
    """Linear warmup then the decay of ``optimizer.lr_decay_style`` (cosine, linear, or
    megatron's WSD) to ``optimizer.min_lr`` at ``optimizer.lr_decay_iters``; on resume the
    configuration wins for every schedule parameter (``override_opt_param_scheduler``). A run
    without a training budget (the tools that take a few steps: benchmark, equivalence
    harness, GPU check, conversion) has no horizon to decay over, so its learning rate stays
    constant after the warmup."""
    cfg, o, t = run.cfg, run.cfg.optimizer, run.cfg.training
    has_length = (o.lr_decay_iters is not None or t.train_iters is not None
                  or t.train_tokens is not None)
    decay_steps = lr_decay_iterations(cfg) if has_length else o.warmup_iters + 1
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_iters, lr_decay_steps=decay_steps,
        lr_decay_style=LR_DECAY_STYLES[o.lr_decay_style] if has_length else "constant",
        wsd_decay_steps=o.lr_wsd_decay_iters, lr_wsd_decay_style=o.lr_wsd_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=max(train_iterations(cfg), 1) if has_length else 1,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)


def _inference_chunks(run: ResolvedRun, config: BoostTransformerConfig) -> List[Any]:
    """Bare model chunks (no DDP) in eval mode on the run's device, initialised like the
    trainer's; bf16 runs are wrapped in megatron's Float16Module as the trainer wraps them."""
    chunks = build_globally_initialised(  # every weight drawn once, docs/design.md §8
        lambda: build_model(config, run.padded_vocab_size, run.seq_length,
                            pg_collection=run.process_groups,
                            rotary_base=run.cfg.model.rotary_base), config, run.seed)
    return [c.eval() for c in on_run_device(chunks, config, run.device)]


def build_run(run: ResolvedRun, *, training: bool = True,
              get_batch: Callable[[Iterator], dict] = next) -> BuiltRun:
    """Build ``run`` on this rank (megatron's process groups must exist).

    Args:
        training: True: DDP-wrapped chunks, megatron's optimizer and the scheduler of the
            configuration; False: bare chunks in eval mode, no optimizer (conversion,
            evaluation, generation, the precision check).
        get_batch: ``get_batch(data_iterator)`` -> dict of [b, s] tokens, labels, loss_mask,
            position_ids on the right device (default: the iterator yields them).
    """
    config = to_transformer_config(run)
    forward_step = make_forward_step(get_batch)
    if not training:
        return BuiltRun(run, config, _inference_chunks(run, config), None, None, forward_step)
    par, o = run.cfg.parallel, run.cfg.optimizer
    chunks = build_ddp_model(config, run.padded_vocab_size, run.seq_length, run.seed,
                             device=run.device, overlap_grad_reduce=par.overlap_grad_reduce,
                             use_distributed_optimizer=par.use_distributed_optimizer,
                             rotary_base=run.cfg.model.rotary_base,
                             pg_collection=run.process_groups)
    optimizer = build_optimizer(
        config, chunks, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        clip_grad=o.clip_grad, use_distributed_optimizer=par.use_distributed_optimizer,
        muon=o, tp_group=getattr(run.process_groups, "tp", None))
    return BuiltRun(run, config, chunks, optimizer, build_scheduler(optimizer, run),
                    forward_step)
