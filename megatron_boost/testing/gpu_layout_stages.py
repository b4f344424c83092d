"""The GPU check's stages that compare layouts against the one-process reference (docs/gpu.md,
docs/design.md §11; their plans and shared pieces are :mod:`megatron_boost.testing.gpu_stages`):

3. naive = boost at TP=1 (the layout-equivalence harness): logits and every gradient after a
   few optimizer steps, fp32 with TF32 off.
8. BOOST's collectives: boost, naive and full at TP=2 against the same global weights at TP=1
   (two processes: gloo on one GPU or the CPU, NCCL with DP and PP where there are GPUs for it),
   then naive and full at TP=2 saved and resumed through the trainer (stage 2's runs).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Dict, Iterable, Optional, Sequence

from megatron_boost.config.modes import TPMode
from megatron_boost.runtime.stages import Row, check, emit, info, one_line
from megatron_boost.testing.gpu_stages import (
    COMPARISON_STEPS,
    FP32_ENV,
    NEGATIVE_CONTROL_ENV,
    Case,
    Plan,
    resume_attention,
    run_cases,
    setup_stage,
)
from megatron_boost.testing.gpu_training_stages import resume_row, resumed_losses

__all__ = ["stage_equivalence", "stage_tensor_parallel", "negative_control",
           "tensor_parallel_layouts"]


# ---------------------------------------------------------------------------------------------
# stages 3 and 8: layouts against the one-process reference (docs/design.md §11)
# ---------------------------------------------------------------------------------------------


def negative_control(stage: int) -> Optional[str]:
    """The negative control this stage runs under, or None: NEGATIVE_CONTROL_ENV is a kind
    for every comparing stage, or ``STAGE=KIND`` pairs (e.g. ``3=weight,8=collective``)."""
    text = os.environ.get(NEGATIVE_CONTROL_ENV, "")
    pairs = [item.partition("=") for item in text.split(",") if item.strip()]
    kinds = {int(s) if sep else stage: kind if sep else s for s, sep, kind in pairs}
    control = kinds.get(stage)
    if control not in (None, "weight", "collective"):
        raise ValueError(f"{NEGATIVE_CONTROL_ENV}={text!r}: a control is weight or collective")
    return control


def fp32_math_mode(stage: int) -> None:
    """fp32 means IEEE fp32: TF32 off in torch, and the overrides that bypass torch's flags
    (FP32_ENV, set before torch started) are off too. A row says which mode ran."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    env = {k: os.environ.get(k) for k in FP32_ENV}
    ieee = env == FP32_ENV and not torch.backends.cuda.matmul.allow_tf32 \
        and not torch.backends.cudnn.allow_tf32 \
        and torch.get_float32_matmul_precision() == "highest"
    check(stage, "math mode", ieee,
          f"{'IEEE fp32' if ieee else 'NOT IEEE fp32'}: matmul allow_tf32="
          f"{torch.backends.cuda.matmul.allow_tf32}, cudnn allow_tf32="
          f"{torch.backends.cudnn.allow_tf32}, float32_matmul_precision="
          f"{torch.get_float32_matmul_precision()}, "
          + ", ".join(f"{k}={v}" for k, v in env.items()))


def comparison_spec(mode: TPMode, tp: int = 1, pp: int = 1, control: Optional[str] = None):
    """A layout of the equivalence harness, run for COMPARISON_STEPS steps with sdpa attention
    (the same core on every layout and device), under ``control`` when given."""
    from megatron_boost.config.layout import Layout
    from megatron_boost.testing.verification import LayoutSpec

    return LayoutSpec(layout=Layout(mode=mode, tp=tp, pp=pp), model={"attention_backend": "sdpa"},
                      steps=COMPARISON_STEPS, corrupt=control == "weight",
                      drop_tp_all_reduce=control == "collective")


def one_process_references(specs) -> Dict[str, dict]:
    """The one-process reference of every spec's reference layout, by its mode, run in this
    process (world of one, on the stage's device)."""
    from megatron_boost.testing.verification import reference_spec, run_many

    refs = {}
    for spec in specs:
        ref = reference_spec(spec)
        if ref.layout.mode not in refs:
            refs[ref.layout.mode] = run_many(0, 1, [(ref, None)])[0]
    return refs


def comparison_rows(stage: int, label: str, per_rank: Sequence[dict]) -> None:
    """Rows of one layout's comparison, worst over its ranks: logits, every gradient shard
    (and the gradient norm), the loss and the parameter updates of all steps."""
    from megatron_boost.testing.verification import TOLERANCES as tol

    def worst(key):
        values = [r[key] for r in per_rank if r[key] is not None]
        return max(values) if values else None

    logits = worst("logits")
    if logits is None:
        emit(Row(stage, f"{label} logits", "n/a", "logits live on the last pipeline stage; "
                                                  "the loss and gradients below cover them"))
    else:
        check(stage, f"{label} logits", logits <= tol["logits"],
              f"max rel diff {logits:.1e} (tolerance {tol['logits']:g})")
    grad, norm = worst("grad"), worst("grad_norm")
    check(stage, f"{label} gradients", grad <= tol["grad"] and norm <= tol["grad_norm"],
          f"{per_rank[0]['n_tensors']} shards per rank, max rel diff {grad:.1e} (tolerance "
          f"{tol['grad']:g}), grad norm {norm:.1e} ({tol['grad_norm']:g})")
    loss, update = worst("loss"), worst("update")
    check(stage, f"{label} loss, updates", loss <= tol["loss"] and update <= tol["update"],
          f"after {COMPARISON_STEPS} steps: loss {loss:.1e} ({tol['loss']:g}), updates "
          f"{update:.1e} ({tol['update']:g})")


def stage_equivalence(plan: Plan, work: Path) -> None:
    """boost against naive at TP=1, from the same global weights (layout-independent init,
    docs/design.md §8): boost fuses the RMSNorm into its A GEMM (§3), naive does not."""
    setup_stage(plan, groups=False)
    fp32_math_mode(3)
    control = negative_control(3)
    if control == "collective":
        emit(Row(3, "negative control", "n/a", "no tensor-parallel collective at TP=1"))
        control = None
    spec = comparison_spec(TPMode.BOOST, control=control)
    reference = one_process_references([spec])[TPMode.NAIVE]
    from megatron_boost.testing.verification import run_many

    comparison_rows(3, "boost vs naive, tp=1", run_many(0, 1, [(spec, reference)]))


def tensor_parallel_layouts(device: str, gpus: int, control: Optional[str]):
    """(world, backend, specs) of each multi-process run: two processes over gloo (on the CPU,
    or sharing one GPU with CUDA tensors); with 2+ GPUs NCCL and DP=2, with 4 also PP=2."""
    at_tp2 = [comparison_spec(mode, tp=2, control=control)
              for mode in (TPMode.BOOST, TPMode.NAIVE, TPMode.FULL)]
    if device != "cuda" or gpus < 2:
        return [(2, "gloo", at_tp2)]
    boost = TPMode.BOOST
    runs = [(2, "nccl", at_tp2 + [comparison_spec(boost, tp=1, control=control)])]  # DP=2
    if gpus >= 4:
        runs.append((4, "nccl", [comparison_spec(boost, tp=2, control=control),  # DP=2
                                 comparison_spec(boost, tp=2, pp=2, control=control)]))
    return runs


def stage_tensor_parallel(plan: Plan, work: Path) -> None:
    """BOOST's collectives on the device: every layout of :func:`tensor_parallel_layouts`
    against its one-process reference, logits and every gradient shard after a few steps."""
    import torch

    from megatron_boost.runtime.spawn import run_distributed
    from megatron_boost.testing.verification import reference_spec, run_many

    setup_stage(plan, groups=False)
    fp32_math_mode(8)
    control = negative_control(8)
    gpus = torch.cuda.device_count() if plan.device == "cuda" else 0
    runs = tensor_parallel_layouts(plan.device, gpus, control)
    refs = one_process_references([s for _, _, specs in runs for s in specs])
    for world, backend, specs in runs:
        where = f"{backend}, {plan.device}" + (f" x{min(world, gpus)}" if gpus else "")
        info(8, f"{world} processes", f"{where}; references: one process, {plan.device}")
        jobs = [(s, refs[reference_spec(s).layout.mode]) for s in specs]
        per_rank = run_distributed(run_many, world, jobs, device=plan.device, backend=backend)
        for i, spec in enumerate(specs):
            layout = spec.layout
            dp = world // (layout.tp * layout.pp)
            comparison_rows(8, f"{layout.mode} tp={layout.tp} pp={layout.pp} dp={dp}",
                            [rank[i] for rank in per_rank])
    if control is None:  # a negative control concerns the comparisons only
        _tp_resume(plan, work, *runs[0][:2])


#: The modes stage 8 saves and resumes at TP=2 (see :func:`_tp_resume`).
RESUME_MODES = (TPMode.NAIVE, TPMode.FULL)


def _tp_resume_worker(rank: int, world: int, plan: Plan, work: str, modes: Sequence[str],
                      attention: str):
    """One rank of a TP=2 trainer, for each of ``modes`` in turn: save at 3, resume from 3
    (stage 8); the (uninterrupted, resumed) metrics of each mode (rank 0's; {} elsewhere)."""
    import torch

    from megatron_boost.testing.gpu_stages import free_memory

    torch.use_deterministic_algorithms(True, warn_only=True)
    results = []
    for mode in modes:
        results.append(resumed_losses(plan, Path(work) / mode, [
            f"parallel.mode={mode}", "parallel.tp=2", f"model.attention_backend={attention}"],
            world))
        free_memory(plan.device)
    return results


def _tp_resume(plan: Plan, work: Path, world: int, backend: str) -> None:
    """naive and full at TP=2 through the real trainer, saved and resumed: the modes whose
    norms are megatron's (Transformer Engine's with its attention on the GPU), so their
    checkpoint state (TE's extra state included) crosses a TP group. Both modes run in one
    spawned world, so its ranks start once (a rank's start-up costs more than a debug run);
    when that world fails, each mode runs again in a world of its own, so the failing mode
    has its FAIL row and the other its own row."""
    from megatron_boost.runtime.spawn import run_distributed

    attention = resume_attention(8, plan)
    try:
        per_mode, _ = run_distributed(_tp_resume_worker, world, plan, str(work),
                                      list(RESUME_MODES), attention, device=plan.device,
                                      backend=backend)
    except Exception:  # noqa: BLE001 - each mode alone below names the one that fails
        run_cases(8, _tp_resume_cases(plan, work, backend, attention), plan.device,
                  error_row=_spawned_fail_row)
        return
    run_cases(8, (Case(_resume_case_name(mode, attention),
                       functools.partial(resume_row, 8, _resume_case_name(mode, attention),
                                         ref, got))
                  for mode, (ref, got) in zip(RESUME_MODES, per_mode)), plan.device)


def _resume_case_name(mode: str, attention: str) -> str:
    return f"{mode} tp=2 save/resume, {attention}, bf16"


def _tp_resume_cases(plan: Plan, work: Path, backend: str, attention: str) -> Iterable[Case]:
    """Each mode's save/resume in a world of its own (after the shared world failed)."""
    for mode in RESUME_MODES:
        case = _resume_case_name(mode, attention)
        yield Case(case, functools.partial(_tp_resume_case, plan, work, backend, case,
                                           mode, attention))


def _tp_resume_case(plan: Plan, work: Path, backend: str, case: str, mode: str,
                    attention: str) -> None:
    from megatron_boost.runtime.spawn import run_distributed

    ((ref, got),), _ = run_distributed(_tp_resume_worker, 2, plan, str(work), [mode],
                                       attention, device=plan.device, backend=backend)
    resume_row(8, case, ref, got)


def _spawned_fail_row(stage: int, case: str, err: BaseException) -> None:
    """A FAIL row of a spawned world's error, cut short: it carries each rank's traceback."""
    check(stage, case, False, one_line(err)[:300])
