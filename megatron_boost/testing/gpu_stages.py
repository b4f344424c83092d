"""The GPU check (``tools/gpu_check.sh``, docs/gpu.md): the stages' plans and the pieces they
share. Each stage is a function ``stage(plan, work)`` run in a process of its own by
:func:`megatron_boost.runtime.stages.run_stages`, printing its rows as it measures them; the
stages live by family:

* :mod:`megatron_boost.testing.gpu_training_stages`, does training work on one process:
  0 environment (device, versions, megatron's chosen optimizer class, attention backend,
  ``CUDA_DEVICE_MAX_CONNECTIONS``); 1 {full, naive, boost} x {te, sdpa, local}: two bf16
  steps at debug shapes; 2 save -> rebuild -> resume through the real trainer, bitwise-equal
  resumed losses; 4 host synchronisations of one whole trainer iteration (the CUDA runtime's
  sync warnings with their Python stacks on the GPU, the host-sync counter on the CPU).
* :mod:`megatron_boost.testing.gpu_layout_stages`, layouts against the one-process reference:
  3 naive = boost at TP=1 (the layout-equivalence harness, docs/design.md §11): logits and
  every gradient after a few optimizer steps, fp32 with TF32 off; 8 BOOST's collectives: boost,
  naive and full at TP=2 against the same global weights at TP=1 (two processes: gloo on one
  GPU or the CPU, NCCL with DP and PP where there are GPUs for it), then naive and full at
  TP=2 saved and resumed through the trainer.
* :mod:`megatron_boost.testing.gpu_measure`, how fast: 5-7.
* :mod:`megatron_boost.testing.gpu_graph_stage`: 9 megatron's per-layer CUDA graphs, naive
  and boost trained with graphs on and off: the same losses, and the step times.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from megatron_boost.config.modes import TPMode
from megatron_boost.runtime.stages import Row, check, emit, one_line


ROOT = Path(__file__).resolve().parents[2]
MODES = tuple(TPMode)
BACKENDS = ("te", "sdpa", "local")

#: Stage numbers, names and the order they run in: what decides whether training works at all
#: (0-3 and the TP stage 8) first, the measurements after.
STAGE_NAMES = {0: "environment", 1: "bf16 steps", 2: "save/resume", 3: "naive=boost",
               4: "host syncs", 5: "throughput", 6: "attention", 7: "layer GEMMs",
               8: "TP=2", 9: "CUDA graphs"}
RUN_ORDER = (0, 1, 2, 3, 8, 4, 9, 5, 6, 7)

#: Negative control of the comparisons (stages 3 and 8), read at the stage's start: ``weight``
#: perturbs one decoder weight shard, ``collective`` drops every tensor-parallel all-reduce
#: (:func:`negative_control`). The stage must then print FAIL (tests/test_gpu_check.py).
NEGATIVE_CONTROL_ENV = "MBOOST_GPU_CHECK_NEGATIVE_CONTROL"

#: Stage 2's deterministic settings, set in its environment before torch starts (cuBLAS reads
#: the workspace setting at handle creation, Transformer Engine its flag at import).
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}

#: The fp32 stages' environment, set before torch starts: NVIDIA's PyTorch containers have set
#: TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1, which makes cuBLAS run fp32 GEMMs in TF32 whatever
#: ``allow_tf32`` says; NVIDIA_TF32_OVERRIDE=0 stops the driver-level override of cuBLAS and
#: cuDNN. The fp32 tolerances (docs/design.md §11) are IEEE fp32's.
FP32_ENV = {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "0", "NVIDIA_TF32_OVERRIDE": "0"}
FP32_STAGES = (3, 8)

#: Optimizer steps before the comparisons of stages 3 and 8 (not the initial loss: after a few
#: steps every weight has moved by its own gradient, so a wrong gradient shard shows).
COMPARISON_STEPS = 3


def stage_environment_variables(stage: int) -> Dict[str, str]:
    """What a stage's process needs in its environment before torch starts: the
    deterministic settings where a stage resumes training (2, 8), the fp32 ones where it
    compares in fp32 (3, 8)."""
    env = dict(DETERMINISTIC_ENV) if stage in (2, 8) else {}
    return {**env, **(FP32_ENV if stage in FP32_STAGES else {})}


# ---------------------------------------------------------------------------------------------
# plans: the sizes of every stage on the GPU and in the CPU dry run
# ---------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """Sizes and limits of every stage; :func:`gpu_plan` or :func:`cpu_plan`. Stages 1-4
    run configs/debug.yaml as it is (2 layers, d=64) on either device."""

    device: str
    limits: Dict[int, float]
    """Seconds each stage may run (its subprocess is killed after that)."""
    deadline: float
    """Seconds the whole check may run; a stage gets at most what is left."""
    throughput_overrides: List[str]
    """Stage 5: on top of configs/cola-350m.yaml, its own budget included (the file sets a
    token budget, which a training.train_iters override replaces)."""
    warmup_steps: int
    """Stage 5: steps not timed (allocator, kernel autotuning)."""
    attention_seq: int = 8192
    """Stage 6: sequence length of the one-layer input (micro-batch 1)."""
    attention_model: str = "cola-1b"
    """Stage 6: configs/<name>.yaml whose layer shape is run."""
    layer_models: Tuple[str, ...] = ("cola-1b", "cola-7b")
    """Stage 7: configs/<name>.yaml whose per-rank layer shapes are run."""
    layer_tps: Tuple[int, ...] = (1, 2, 4)
    """Stage 7: tensor-parallel sizes whose one-rank shapes are run."""
    layer_tokens: Tuple[int, int] = (2048, 4)
    """Stage 7: (sequence, micro-batch) of the layer input."""
    timing_iters: int = 10
    """Timed repetitions (median) of a layer or GEMM set, after one warm-up."""


def gpu_plan() -> Plan:
    return Plan(
        device="cuda",
        # stage 0 pays the cold start: first imports of torch, megatron and TE, CUDA context;
        # stage 8 pays three more: its ranks start twice (comparisons, then save/resume)
        limits={0: 90, 1: 90, 2: 100, 3: 60, 8: 150, 4: 60, 9: 60, 5: 100, 6: 60, 7: 80},
        deadline=540.0,
        throughput_overrides=["parallel.tp=1", "training.micro_batch_size=4",
                              "training.global_batch_size=4", "training.train_iters=20",
                              "optimizer.warmup_iters=1"],
        warmup_steps=5)


def cpu_plan() -> Plan:
    tiny = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
            "model.num_attention_heads=4", "model.attn_rank=16", "model.mlp_rank=16",
            "model.vocab_size=256", "model.seq_length=32"]
    return Plan(
        device="cpu",
        # generous: the suite shares its cores; a limit here catches a hang, not slowness
        limits={s: 300 for s in STAGE_NAMES},
        deadline=1500.0,
        throughput_overrides=["parallel.tp=1", *tiny, "training.micro_batch_size=2",
                              "training.global_batch_size=2", "training.train_iters=3",
                              "optimizer.warmup_iters=1"],
        warmup_steps=1, attention_seq=128, attention_model="debug", layer_models=("debug",),
        layer_tps=(1, 2), layer_tokens=(32, 2), timing_iters=2)


# ---------------------------------------------------------------------------------------------
# common pieces of the stages (run inside a stage's subprocess)
# ---------------------------------------------------------------------------------------------


def setup_stage(plan: Plan, seed: int = 1234, groups: bool = True) -> None:
    """A world of one on the plan's device (CPU mode for the dry run), with TP=PP=1 groups
    unless ``groups`` is False (the harness and the trainer create their own)."""
    from megatron_boost.runtime.cpu_mode import maybe_use_cpu
    from megatron_boost.train.distributed import init_distributed
    from megatron_boost.train.resilience import process_group_timeout
    from megatron_boost.train.step import initialize_parallel

    maybe_use_cpu(plan.device)
    init_distributed(plan.device, process_group_timeout(5.0))
    if groups:
        initialize_parallel(1, 1, None, seed=seed, timeout_minutes=5.0)


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def load_config(config: str, overrides: Sequence[str], device: str):
    from megatron_boost.config.run import load_run_config

    return load_run_config(str(ROOT / config), [*overrides, f"training.device={device}"])


def te_unavailable_reason(device: str) -> Optional[str]:
    """Why Transformer Engine attention cannot run here, or None when it can."""
    if device != "cuda":
        return "Transformer Engine needs CUDA (this is the CPU dry run)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # ImportError, or OSError from missing CUDA libraries
        return f"transformer_engine does not import ({one_line(err)})"
    return None


def backend_unavailable(backend: str, te_why: Optional[str]) -> Optional[str]:
    """The n/a text of a case on attention ``backend`` (:class:`Case`): ``te_why``
    (:func:`te_unavailable_reason`) for Transformer Engine's, None for one that runs here."""
    return f"unavailable: {te_why}" if backend == "te" and te_why is not None else None


def resume_attention(stage: int, plan: Plan) -> str:
    """The attention backend a stage's save/resume runs with: Transformer Engine's, whose
    extra state the checkpoint must carry, where it runs here; else sdpa, after an n/a row
    saying why."""
    te_why = te_unavailable_reason(plan.device)
    if te_why is None:
        return "te"
    emit(Row(stage, "te attention", "n/a", f"unavailable: {te_why}; resume runs with sdpa"))
    return "sdpa"


class Case(NamedTuple):
    """One case of a stage: the name its row carries, its measurement (which prints the row;
    None for a case that cannot run), and why it cannot run here (None: it can; else the
    text of its n/a row)."""

    name: str
    run: Optional[Callable[[], None]]
    unavailable: Optional[str] = None


def fail_row(stage: int, case: str, err: BaseException) -> None:
    """A case that raised: a FAIL row with the error on one line."""
    check(stage, case, False, one_line(err))


def run_cases(stage: int, cases: Iterable[Case], device: str,
              error_row: Callable[[int, str, BaseException], None] = fail_row) -> None:
    """Each case of a stage in turn: one that cannot run here is an n/a row saying why; one
    that raises is a row of ``error_row`` (a FAIL row, unless the stage reports some errors
    otherwise), and the next case still runs; the device's memory is freed after each case.
    ``cases`` is read lazily, so a case is set up only when the one before it has finished."""
    for case in cases:
        if case.unavailable is not None:
            emit(Row(stage, case.name, "n/a", case.unavailable))
            continue
        try:
            case.run()
        except Exception as err:  # one case failing does not hide the others
            error_row(stage, case.name, err)
        free_memory(device)


@dataclass
class Trainable:
    """A model chunk list, its optimizer and a batch source: what train_step needs."""

    cfg: object
    ddp: list
    optimizer: object
    forward_step: Callable
    micro_batches: list


def build_trainable(cfg, precision: str, device: str,
                     num_microbatches: Optional[int] = None) -> Trainable:
    """The run's model from the one builder (layout-independent init from the run's seed, so
    every mode starts from the same global weights, docs/design.md §8), megatron's optimizer
    and one fixed global batch."""
    from megatron_boost.config.resolved import resolve_run
    from megatron_boost.data.synthetic import synthetic_microbatches
    from megatron_boost.train.build import build_run

    # A constant learning rate from the first step (no warmup), as the benchmark uses: the
    # check takes a few steps and reads whether the loss falls.
    cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, warmup_iters=0))
    run = resolve_run(cfg, device, vocab_size=cfg.model.vocab_size).with_precision(precision)
    built = build_run(run)
    t = cfg.training
    gbs = t.micro_batch_size * (num_microbatches or t.global_batch_size // t.micro_batch_size)
    micro = synthetic_microbatches(cfg.model.vocab_size, cfg.model.seq_length,
                                   t.micro_batch_size, gbs, run.seed + 1)
    micro = [{k: v.to(device) for k, v in m.items()} for m in micro]
    return Trainable(cfg, built.chunks, built.optimizer, built.forward_step, micro)


def train_once(tr: Trainable) -> dict:
    """One optimizer step on the trainable's fixed global batch."""
    from megatron_boost.train.step import train_step

    t = tr.cfg.training
    return train_step(tr.forward_step, [iter(tr.micro_batches)], tr.ddp, tr.optimizer,
                      len(tr.micro_batches), tr.cfg.model.seq_length, t.micro_batch_size)


def parameters_of(tr: Trainable):
    return [p for chunk in tr.ddp for p in chunk.module.parameters()]
