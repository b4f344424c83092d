"""Is a parallel layout the same function as one process? (docs/design.md §11)

:func:`run_layout` runs in every rank of a layout: it builds the model of the given mode from one
seed (layout-independent initialisation, so every layout holds the same global weights), runs
one global batch through megatron-core's pipeline schedule, DDP and optimizer, and either
returns the global gradients and updated parameters (the one-process reference, world size 1)
or compares its own loss, every gradient shard and every updated parameter shard with the
reference's matching slice.

Used by the test suite and by ``megatron-boost-verify-parallel``
(:mod:`megatron_boost.cli.verify_parallel`).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional

import torch

from megatron_boost.config.layout import Layout
from megatron_boost.config.modes import TPMode

__all__ = ["LayoutSpec", "run_layout", "TOLERANCES", "layout_run_config", "model_config",
           "layout_batches", "build_layout", "reference_spec", "run_many", "model_collectives",
           "dropped_tp_all_reduces"]

# fp32 tolerances. The layouts compute the same sums in different orders (split GEMMs,
# all-reduce order, micro-batch accumulation), so results agree to fp32 rounding through two
# layers, attention, the head and the loss: observed ≤ ~1e-6 relative. Any sharding error is
# O(1). Gradients and parameter updates are compared per tensor, relative to the tensor's
# largest reference magnitude.
# Logits are the same sums as the loss, before it averages them: compared per element relative
# to the largest reference logit, with the loss's margin (observed ~1e-6 after three steps).
TOLERANCES = {"loss": 1e-5, "grad": 1e-4, "update": 1e-3, "grad_norm": 1e-5, "logits": 1e-5}


@dataclass
class LayoutSpec:
    """One layout to check (plain data, picklable for spawned workers)."""

    layout: Layout = Layout()
    """The mode, TP, PP, virtual-pipeline and sequence-parallel settings (``parallel.*``); the
    data-parallel size follows from the world size."""
    model: Dict = field(default_factory=dict)
    """Overrides of the model section (ModelConfig field names)."""
    seq_length: int = 16
    micro_batch_size: int = 2
    global_batch_size: int = 8
    seed: int = 1234
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    step: bool = True
    """Also take one Adam step (clipping on) and compare the updated parameters."""
    corrupt: bool = False
    """Negative control: perturb one parameter shard before running."""
    steps: int = 1
    """Optimizer steps on the same global batch; the gradients compared are the last step's,
    the updates those of all steps together, the loss the last step's."""
    drop_tp_all_reduce: bool = False
    """Negative control: every all-reduce over the tensor-parallel group runs on a copy, so its
    result never reaches the model (a dropped collective, without a hang)."""
    optimizer: Dict = field(default_factory=dict)
    """Overrides of the optimizer section (OptimizerConfig field names), e.g. name: muon."""
    interleave_halves: bool = False
    """``parallel.interleave_halves`` (boost, tp > 1): each layer as two interleaved halves of
    the micro-batch."""


def layout_run_config(spec: LayoutSpec):
    """The RunConfig of a layout (validated; raises ValueError for a bad one). Large Adam ε
    keeps the first update a smooth function of the gradient (g / (|g| + ε)), so fp32 rounding
    in tiny gradients cannot flip an update's sign; a small clip threshold makes the update
    depend on the true global gradient norm; no warmup, so the one step runs at optimizer.lr."""
    from megatron_boost.config.run import ModelConfig, OptimizerConfig, RunConfig

    cfg = RunConfig()
    cfg.model = ModelConfig(**{**asdict(ModelConfig()), **spec.model})
    cfg.model.seq_length = spec.seq_length
    layout = spec.layout
    cfg.parallel.mode, cfg.parallel.tp, cfg.parallel.pp = layout.mode.value, layout.tp, layout.pp
    cfg.parallel.vpp = layout.vpp
    cfg.parallel.overlap_grad_reduce = spec.overlap_grad_reduce
    cfg.parallel.sequence_parallel = layout.sequence_parallel
    cfg.parallel.use_distributed_optimizer = spec.use_distributed_optimizer
    cfg.parallel.interleave_halves = spec.interleave_halves
    cfg.training.seed = spec.seed
    cfg.training.precision = "fp32"  # the tolerances are fp32's, on the GPU too
    cfg.training.micro_batch_size = spec.micro_batch_size
    cfg.training.global_batch_size = spec.global_batch_size
    cfg.optimizer = OptimizerConfig(**{**asdict(OptimizerConfig(
        lr=1e-2, min_lr=1e-3, warmup_iters=0, weight_decay=0.1, adam_eps=1e-3,
        clip_grad=0.05)), **spec.optimizer})
    return cfg.validate()


def model_config(spec: LayoutSpec):
    """(RunConfig, BoostTransformerConfig) of a layout; raises ValueError for a bad one."""
    from megatron_boost.config.resolved import resolve_run, to_transformer_config

    cfg = layout_run_config(spec)
    return cfg, to_transformer_config(resolve_run(cfg))


def layout_batches(spec: LayoutSpec, vocab: int, dp: int, dp_rank: int):
    """This DP rank's synthetic micro-batches of the layout's global batch (seed + 1)."""
    from megatron_boost.data.synthetic import synthetic_microbatches

    return synthetic_microbatches(vocab, spec.seq_length, spec.micro_batch_size,
                                  spec.global_batch_size, spec.seed + 1, dp, dp_rank)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def build_layout(spec: LayoutSpec):
    """(cfg, built run, sharded_params entries) of a layout on this rank, through the one
    builder (``train.build.build_run``); with ``spec.corrupt``, one parameter shard is
    perturbed (the negative control)."""
    from megatron_boost.config.resolved import resolve_run
    from megatron_boost.model.init import sharded_params
    from megatron_boost.train.build import build_run
    from megatron_boost.train.step import initialize_parallel

    cfg = layout_run_config(spec)
    dp = initialize_parallel(spec.layout.tp, spec.layout.pp, spec.layout.vpp, spec.seed)
    if spec.global_batch_size % (spec.micro_batch_size * dp):
        raise ValueError(f"global_batch_size ({spec.global_batch_size}) must be divisible by "
                         f"micro_batch_size·dp ({spec.micro_batch_size}·{dp})")
    built = build_run(resolve_run(cfg))
    entries = [e for m in built.chunks for e in sharded_params(m.module)]
    if spec.corrupt:
        # Negative control: swap two rows of one sharded decoder matrix on this rank (a
        # decoder weight acts on every token; an embedding row may meet none of the batch).
        key, _, _, param = next(e for e in entries if e[0].startswith("decoder.")
                                and e[3].dim() == 2 and e[3].shape[0] > 1)
        with torch.no_grad():
            param[[0, 1]] = param[[1, 0]]
    return cfg, built, entries


def run_layout(rank: int, world: int, spec: LayoutSpec, reference: Optional[dict] = None):
    """Run ``spec`` on this rank. Without ``reference``: return the reference data (world 1).
    With it: return the worst relative differences against it."""
    from megatron.core import parallel_state

    from megatron_boost.train.step import train_step

    cfg, built, entries = build_layout(spec)
    before = {key: param.detach().clone() for key, _, _, param in entries}
    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    device = next(built.chunks[0].parameters()).device
    micro = [{k: v.to(device) for k, v in m.items()}
             for m in layout_batches(spec, cfg.model.vocab_size, dp, dp_rank)]
    with dropped_tp_all_reduces(spec.drop_tp_all_reduce):
        for _ in range(spec.steps):
            iterators = [iter(list(micro)) for _ in built.chunks]
            result = train_step(built.forward_step, iterators, built.chunks, built.optimizer,
                                len(micro), spec.seq_length, spec.micro_batch_size)
        logits = _logits(spec, cfg, built)
    grads = {key: param.main_grad.detach().clone() for key, _, _, param in entries}
    after = {key: param.detach().clone() for key, _, _, param in entries}
    updates = {k: after[k] - before[k] for k in after}
    if reference is None:
        if world != 1:
            raise ValueError("the reference runs in one process (world size 1)")
        return {"loss": result["loss"], "grad_norm": result["grad_norm"], "grads": grads,
                "updates": updates, "logits": logits}
    out = _compare(spec, result, grads, updates, entries, reference)
    out["logits"] = _logits_difference(logits, reference.get("logits"))
    return out


@contextlib.contextmanager
def dropped_tp_all_reduces(active: bool):
    """While active, an all-reduce over the tensor-parallel group reduces a copy of its
    tensor: every rank still takes part (no hang), but the sum never reaches the caller."""
    if not active:
        yield
        return
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    real = torch.distributed.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        if kwargs.get("group", args[1] if len(args) > 1 else None) is group:
            tensor = tensor.clone()
        return real(tensor, *args, **kwargs)

    torch.distributed.all_reduce = all_reduce
    try:
        yield
    finally:
        torch.distributed.all_reduce = real


def _logits(spec: LayoutSpec, cfg, built) -> Optional[torch.Tensor]:
    """This rank's logits [b, s, V/tp] (its vocabulary shard) of the global batch's first
    micro-batch after the steps, or None with a pipeline (logits live on the last stage only
    and need the schedule to get there)."""
    if spec.layout.pp != 1:
        return None
    batch = layout_batches(spec, cfg.model.vocab_size, 1, 0)[0]
    device = next(built.chunks[0].parameters()).device
    with torch.no_grad():
        logits = built.chunks[0](batch["tokens"].to(device), batch["position_ids"].to(device),
                                 None)
    return logits.detach().float().cpu()


def _logits_difference(logits, reference) -> Optional[float]:
    """Relative difference of this rank's vocabulary shard of the logits against the same
    columns of the one-process logits."""
    if logits is None or reference is None:
        return None
    from megatron.core import parallel_state

    width = logits.shape[-1]  # V/tp
    first = parallel_state.get_tensor_model_parallel_rank() * width
    return _rel(logits, reference[..., first:first + width])


def _compare(spec: LayoutSpec, result, grads, updates, entries, reference) -> dict:
    """Worst relative differences of this rank's loss, gradient shards, gradient norm and
    parameter updates against the matching slices of the reference."""
    out = {"loss": None, "grad": 0.0, "update": 0.0, "grad_norm": 0.0, "n_tensors": 0,
           "worst_grad_key": None}
    if result["loss"] is not None:
        out["loss"] = abs(result["loss"] - reference["loss"]) / abs(reference["loss"])
    out["grad_norm"] = abs(result["grad_norm"] - reference["grad_norm"]) / reference["grad_norm"]
    for key, _, slicer, param in entries:
        if key not in reference["grads"]:
            raise KeyError(f"parameter {key} has no counterpart in the reference model")
        out["n_tensors"] += 1
        if not spec.use_distributed_optimizer:
            # With the distributed optimizer each DP rank holds only its shard of the reduced
            # gradient buffer; the updated parameters (all-gathered) are compared instead.
            e = _rel(grads[key], slicer(reference["grads"][key]))
            if e > out["grad"]:
                out["grad"], out["worst_grad_key"] = e, key
        out["update"] = max(out["update"], _rel(updates[key], slicer(reference["updates"][key])))
    return out


def reference_spec(spec: LayoutSpec) -> LayoutSpec:
    """The one-process counterpart of a layout: same model and batch, TP = PP = DP = 1.
    Bottleneck layouts (naive, boost) are all checked against the one-process naive model,
    whose norms and attention are megatron-core's own modules."""
    mode = TPMode.FULL if spec.layout.mode is TPMode.FULL else TPMode.NAIVE
    return LayoutSpec(layout=Layout(mode=mode), model=dict(spec.model), seq_length=spec.seq_length,
                      micro_batch_size=spec.micro_batch_size,
                      global_batch_size=spec.global_batch_size, seed=spec.seed,
                      optimizer=dict(spec.optimizer), steps=spec.steps)


def run_many(rank: int, world: int, jobs):
    """Run several (spec, reference) jobs in one set of processes, one after the other."""
    from megatron.core import parallel_state

    out = []
    for spec, reference in jobs:
        out.append(run_layout(rank, world, spec, reference))
        parallel_state.destroy_model_parallel()
    return out


def model_collectives(rank: int, world: int, spec: LayoutSpec):
    """The TP collectives of one forward and backward of the whole model (TP = world size):
    a list of (direction, kind, width, numel) in issue order."""
    from megatron.core import parallel_state

    from megatron_boost.measure.collectives import record_collectives
    from megatron_boost.config.resolved import resolve_run
    from megatron_boost.train.build import build_run
    from megatron_boost.train.step import initialize_parallel

    cfg = layout_run_config(spec)
    initialize_parallel(spec.layout.tp, 1, None, spec.seed)
    model = build_run(resolve_run(cfg)).chunks[0]
    batch = layout_batches(spec, cfg.model.vocab_size, 1, 0)[0]
    with record_collectives(parallel_state.get_tensor_model_parallel_group()) as log:
        out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        out.float().mean().backward()
    parallel_state.destroy_model_parallel()
    return [(r.direction, r.kind, r.width, r.numel) for r in log.records]
