"""The stages of the GPU check (``tools/gpu_check.sh``, docs/gpu.md) that decide whether
training works: each is a function ``stage(plan, work)`` run in a process of its own by
:func:`megatron_boost.runtime.stages.run_stages`, printing its rows as it measures them.

0. environment: device, versions, megatron's chosen optimizer class, attention backend,
   ``CUDA_DEVICE_MAX_CONNECTIONS``.
1. {full, naive, boost} x {te, sdpa, local}: two bf16 steps at debug shapes.
2. save -> rebuild -> resume through the real trainer, bitwise-equal resumed losses.
3. naive = boost at TP=1 (the layout-equivalence harness, docs/design.md §11): logits and every
   gradient after a few optimizer steps, fp32 with TF32 off.
8. BOOST's collectives: boost, naive and full at TP=2 against the same global weights at TP=1
   (two processes: gloo on one GPU or the CPU, NCCL with DP and PP where there are GPUs for it),
   then naive and full at TP=2 saved and resumed through the trainer.
4. host synchronisations of one whole trainer iteration: the CUDA runtime's sync warnings with
   their Python stacks on the GPU, the host-sync counter on the CPU.

The measuring stages (5-7) are :mod:`megatron_boost.testing.gpu_measure`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from megatron_boost.runtime.stages import Row, check, emit, info, one_line

ROOT = Path(__file__).resolve().parents[2]
MODES = ("full", "naive", "boost")
BACKENDS = ("te", "sdpa", "local")

#: Stage numbers, names and the order they run in: what decides whether training works at all
#: (0-3 and the TP stage 8) first, the measurements after.
STAGE_NAMES = {0: "environment", 1: "bf16 steps", 2: "save/resume", 3: "naive=boost",
               4: "host syncs", 5: "throughput", 6: "attention", 7: "layer GEMMs",
               8: "TP=2"}
RUN_ORDER = (0, 1, 2, 3, 8, 4, 5, 6, 7)

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
        limits={0: 90, 1: 90, 2: 100, 3: 60, 8: 150, 4: 60, 5: 100, 6: 60, 7: 80},
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


def _resume_attention(stage: int, plan: Plan) -> str:
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


# ---------------------------------------------------------------------------------------------
# stage 0: environment
# ---------------------------------------------------------------------------------------------


def _device_text(device: str) -> Tuple[str, str]:
    """(the device, its CUDA stack's versions)."""
    import torch

    if device != "cuda":
        return f"cpu (dry run; {torch.get_num_threads()} threads)", "CUDA not used"
    from megatron_boost.runtime.devices import peak_dense_bf16_tflops

    props = torch.cuda.get_device_properties(0)
    peak = peak_dense_bf16_tflops(props.name)
    peak_text = "not in the table (MFU n/a)" if peak is None else f"{peak:g} TFLOP/s"
    nccl = torch.cuda.nccl.version()  # a tuple, an int in older torch
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return (f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB,"
            f" {torch.cuda.device_count()} visible) | peak dense bf16 {peak_text}",
            f"CUDA {torch.version.cuda} | cuDNN {torch.backends.cudnn.version()} | NCCL {nccl}")


def _optimizer_text(device: str) -> str:
    """The classes megatron's get_megatron_optimizer chose for a bf16 model (Transformer
    Engine's or apex's fused Adam when installed, else torch's AdamW)."""
    from megatron_boost.train.megatron_fixes import inner_torch_optimizers

    tr = build_trainable(load_config("configs/debug.yaml", [], device), "bf16", device)
    inner = inner_torch_optimizers(tr.optimizer)
    chain = getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])
    megatron_classes = "+".join(sorted({type(o).__name__ for o in chain}))
    torch_classes = sorted({f"{type(o).__module__}.{type(o).__name__}" for o in inner})
    fused = sorted({str(g.get("fused")) for o in inner for g in o.param_groups})
    return (f"{type(tr.optimizer).__name__} of {megatron_classes} over {torch_classes} | "
            f"fused={fused}")


def stage_environment(plan: Plan, work: Path) -> None:
    import platform

    import torch

    from megatron_boost.config.resolved import resolve_run

    setup_stage(plan)
    device, cuda = _device_text(plan.device)
    info(0, "device", device)
    from megatron_boost.runtime.backends import package_version

    te = package_version("transformer_engine", ("transformer-engine", "transformer_engine"))
    info(0, "versions", f"python {platform.python_version()} | torch {torch.__version__} | "
                        f"megatron-core {package_version('megatron.core', ('megatron-core',))} | "
                        f"transformer-engine {te} | apex {package_version('apex', ('apex',))} | "
                        f"{cuda}")
    info(0, "optimizer (bf16)", _optimizer_text(plan.device))
    debug = load_config("configs/debug.yaml", [], plan.device)
    run = resolve_run(debug, plan.device, vocab_size=debug.model.vocab_size)
    info(0, "attention backend (auto)", f"{run.attention_backend} ({run.attention_reason})")
    te_why = te_unavailable_reason(plan.device)
    info(0, "transformer engine", "imports" if te_why is None else f"unavailable: {te_why}")
    conns = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    text = f"{conns!r}" + ("" if conns == "1" else
                           " (megatron orders TP communication with 1; gpu_check.sh sets it)")
    if plan.device != "cuda":
        info(0, "CUDA_DEVICE_MAX_CONNECTIONS", text)
        return
    check(0, "CUDA_DEVICE_MAX_CONNECTIONS", conns == "1", text)
    info(0, "TF32", f"matmul allow_tf32={torch.backends.cuda.matmul.allow_tf32} | "
                    f"cudnn allow_tf32={torch.backends.cudnn.allow_tf32}")


# ---------------------------------------------------------------------------------------------
# stage 1: two bf16 steps per mode and attention backend
# ---------------------------------------------------------------------------------------------


def stage_steps(plan: Plan, work: Path) -> None:
    setup_stage(plan)
    run_cases(1, _step_cases(plan, te_unavailable_reason(plan.device)), plan.device)


def _step_cases(plan: Plan, te_why: Optional[str]) -> Iterable[Case]:
    for mode in MODES:
        for backend in BACKENDS:
            case = f"{mode} / {backend}"
            yield Case(case, functools.partial(_two_steps, plan, case, mode, backend),
                       backend_unavailable(backend, te_why))


def _two_steps(plan: Plan, case: str, mode: str, backend: str) -> None:
    cfg = load_config("configs/debug.yaml", [f"parallel.mode={mode}",
                                             f"model.attention_backend={backend}"], plan.device)
    tr = build_trainable(cfg, "bf16", plan.device)
    first, second = train_once(tr), train_once(tr)  # the same batch twice: the loss must go down
    params = parameters_of(tr)
    on_device = all(p.device.type == plan.device for p in params)
    losses = (first["loss"], second["loss"])
    norm = second["grad_norm"]  # None only without clipping (debug.yaml clips at 1.0)
    finite = all(math.isfinite(x) for x in losses) and norm is not None and math.isfinite(norm)
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in params})
    check(1, case, finite and losses[1] < losses[0] and on_device and not second["skipped"],
          f"loss {losses[0]:.4f} -> {losses[1]:.4f} | grad norm "
          f"{'none' if norm is None else f'{norm:.3g}'} | "
          f"{sum(p.numel() for p in params) / 1e6:.2f}M params ({'/'.join(dtypes)}) on "
          f"{sorted({str(p.device) for p in params})}")


# ---------------------------------------------------------------------------------------------
# stage 2: save -> rebuild -> resume through the trainer
# ---------------------------------------------------------------------------------------------


def _trainer_run(plan: Plan, run_dir: Path, overrides: Sequence[str],
                 world_size: int = 1) -> Dict[int, dict]:
    """The trainer (``train.trainer.train``, what pretrain's main runs) in this process, its
    console output to run_dir/console.log (console.rank<K>.log on rank K > 0); returns the
    metrics.jsonl records by iteration on rank 0 (which writes them), {} elsewhere. Each call
    builds the model from scratch; a world of one is shut down at the end, a larger one (a
    spawned world, stage 8) keeps its process group and loses only megatron's groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_boost.config.run import load_run_config
    from megatron_boost.runtime.cpu_mode import cpu_mode_left_as_found, maybe_use_cpu
    from megatron_boost.train import distributed
    from megatron_boost.train.trainer import train

    run_dir.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    cfg = load_run_config(str(ROOT / "configs/debug.yaml"), [
        f"training.device={plan.device}", "training.precision=bf16", "data.mock=true",
        "logging.tensorboard=false", f"logging.run_dir={run_dir}", *overrides], world_size)
    console = run_dir / ("console.log" if rank == 0 else f"console.rank{rank}.log")
    with open(console, "w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log), cpu_mode_left_as_found():
        try:
            rc = train(cfg, maybe_use_cpu(plan.device))
        finally:
            if world_size == 1:
                distributed.shutdown()
            else:
                parallel_state.destroy_model_parallel()
    if rc != 0:
        tail = console.read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"training exited with {rc}: {' | '.join(tail)}")
    if rank != 0:
        return {}
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["iteration"]: r for r in map(json.loads, filter(str.strip, lines))}


#: Six iterations, a checkpoint at 3: what stages 2 and 8 save, resume and compare.
RESUME_OVERRIDES = ["training.train_iters=6", "optimizer.warmup_iters=2",
                    "checkpoint.save_interval=3", "training.eval_interval=100",
                    "training.eval_iters=0", "logging.log_interval=1"]


def resumed_losses(plan: Plan, work: Path, overrides: Sequence[str], world_size: int = 1):
    """(uninterrupted, resumed) metrics by iteration (rank 0; {} elsewhere): six iterations
    with a checkpoint at 3, then a second trainer that loads iteration 3 and trains 4-6."""
    common = [*overrides, *RESUME_OVERRIDES]
    ref = _trainer_run(plan, work / "uninterrupted", common, world_size)
    ckpt = work / "uninterrupted" / "checkpoints" / "iter_0000003"
    got = _trainer_run(plan, work / "resumed", [*common, f"checkpoint.load={ckpt}"], world_size)
    return ref, got


def resume_row(stage: int, case: str, ref: Dict[int, dict], got: Dict[int, dict]) -> None:
    """ok when the resumed losses of iterations 4-6 equal the uninterrupted run's bitwise."""
    diffs = [abs(got[i]["loss"] - ref[i]["loss"]) for i in (4, 5, 6)]
    check(stage, case, max(diffs) == 0.0 and sorted(got) == [4, 5, 6],
          f"loss it 1 {ref[1]['loss']:.4f}, it 6 {ref[6]['loss']:.4f} | resumed at 3: "
          f"iterations {sorted(got)}, max |diff| over 4-6 {max(diffs):.1e}"
          + (" (bitwise)" if max(diffs) == 0.0 else ""))


def stage_resume(plan: Plan, work: Path) -> None:
    import torch

    # Deterministic kernels where torch has them; warn_only: an op without one warns (in the
    # stage log) instead of stopping the check, and the comparison below then shows it.
    torch.use_deterministic_algorithms(True, warn_only=True)
    settings = ", ".join(f"{k}={v}" for k, v in DETERMINISTIC_ENV.items())
    info(2, "deterministic settings", f"torch.use_deterministic_algorithms(True, warn_only=True)"
                                      f", {settings}; criterion: bitwise-equal losses")
    run_cases(2, _resume_cases(plan, work, _resume_attention(2, plan)), plan.device)


def _resume_cases(plan: Plan, work: Path, backend: str) -> Iterable[Case]:
    for dist_opt in (True, False):
        case = f"dist-opt {'on' if dist_opt else 'off'}, {backend} attention, bf16"
        yield Case(case, functools.partial(_resume_case, plan, work / f"resume_{int(dist_opt)}",
                                           case, dist_opt, backend))


def _resume_case(plan: Plan, work: Path, case: str, dist_opt: bool, backend: str) -> None:
    ref, got = resumed_losses(plan, work, [
        f"parallel.use_distributed_optimizer={str(dist_opt).lower()}",
        f"model.attention_backend={backend}"])
    resume_row(2, case, ref, got)


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


def comparison_spec(mode: str, tp: int = 1, pp: int = 1, control: Optional[str] = None):
    """A layout of the equivalence harness, run for COMPARISON_STEPS steps with sdpa attention
    (the same core on every layout and device), under ``control`` when given."""
    from megatron_boost.testing.verification import LayoutSpec

    return LayoutSpec(mode=mode, tp=tp, pp=pp, model={"attention_backend": "sdpa"},
                      steps=COMPARISON_STEPS, corrupt=control == "weight",
                      drop_tp_all_reduce=control == "collective")


def one_process_references(specs) -> Dict[str, dict]:
    """The one-process reference of every spec's reference layout, by its mode, run in this
    process (world of one, on the stage's device)."""
    from megatron_boost.testing.verification import reference_spec, run_many

    refs = {}
    for spec in specs:
        ref = reference_spec(spec)
        if ref.mode not in refs:
            refs[ref.mode] = run_many(0, 1, [(ref, None)])[0]
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
    spec = comparison_spec("boost", control=control)
    reference = one_process_references([spec])["naive"]
    from megatron_boost.testing.verification import run_many

    comparison_rows(3, "boost vs naive, tp=1", run_many(0, 1, [(spec, reference)]))


def tensor_parallel_layouts(device: str, gpus: int, control: Optional[str]):
    """(world, backend, specs) of each multi-process run: two processes over gloo (on the CPU,
    or sharing one GPU with CUDA tensors); with 2+ GPUs NCCL and DP=2, with 4 also PP=2."""
    at_tp2 = [comparison_spec(mode, tp=2, control=control) for mode in ("boost", "naive", "full")]
    if device != "cuda" or gpus < 2:
        return [(2, "gloo", at_tp2)]
    runs = [(2, "nccl", at_tp2 + [comparison_spec("boost", tp=1, control=control)])]  # DP=2
    if gpus >= 4:
        runs.append((4, "nccl", [comparison_spec("boost", tp=2, control=control),  # DP=2
                                 comparison_spec("boost", tp=2, pp=2, control=control)]))
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
        jobs = [(s, refs[reference_spec(s).mode]) for s in specs]
        per_rank = run_distributed(run_many, world, jobs, device=plan.device, backend=backend)
        for i, spec in enumerate(specs):
            dp = world // (spec.tp * spec.pp)
            comparison_rows(8, f"{spec.mode} tp={spec.tp} pp={spec.pp} dp={dp}",
                            [rank[i] for rank in per_rank])
    if control is None:  # a negative control concerns the comparisons only
        _tp_resume(plan, work, *runs[0][:2])


def _tp_resume_worker(rank: int, world: int, plan: Plan, work: str, mode: str,
                      attention: str):
    """One rank of a TP=2 trainer: save at 3, resume from 3 (stage 8)."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    return resumed_losses(plan, Path(work), [f"parallel.mode={mode}", "parallel.tp=2",
                                             f"model.attention_backend={attention}"], world)


def _tp_resume(plan: Plan, work: Path, world: int, backend: str) -> None:
    """naive and full at TP=2 through the real trainer, saved and resumed: the modes whose
    norms are megatron's (Transformer Engine's with its attention on the GPU), so their
    checkpoint state (TE's extra state included) crosses a TP group."""
    attention = _resume_attention(8, plan)
    run_cases(8, _tp_resume_cases(plan, work, backend, attention), plan.device,
              error_row=_spawned_fail_row)


def _tp_resume_cases(plan: Plan, work: Path, backend: str, attention: str) -> Iterable[Case]:
    for mode in ("naive", "full"):
        case = f"{mode} tp=2 save/resume, {attention}, bf16"
        yield Case(case, functools.partial(_tp_resume_case, plan, work / mode, backend, case,
                                           mode, attention))


def _tp_resume_case(plan: Plan, work: Path, backend: str, case: str, mode: str,
                    attention: str) -> None:
    from megatron_boost.runtime.spawn import run_distributed

    (ref, got), _ = run_distributed(_tp_resume_worker, 2, plan, str(work), mode, attention,
                                    device=plan.device, backend=backend)
    resume_row(8, case, ref, got)


def _spawned_fail_row(stage: int, case: str, err: BaseException) -> None:
    """A FAIL row of a spawned world's error, cut short: it carries each rank's traceback."""
    check(stage, case, False, one_line(err)[:300])


# ---------------------------------------------------------------------------------------------
# stage 4: host synchronisations of a whole trainer iteration
# ---------------------------------------------------------------------------------------------


def _trainer(plan: Plan, run_dir: Path, layers: int, micro: int):
    from megatron_boost.train.trainer import Trainer

    cfg = load_config("configs/debug.yaml", [
        f"model.num_layers={layers}", "training.micro_batch_size=2",
        f"training.global_batch_size={2 * micro}", "training.train_iters=20",
        "training.eval_iters=0", "logging.log_interval=100", "logging.tensorboard=false",
        f"logging.run_dir={run_dir}", "data.mock=true"], plan.device)
    return Trainer(cfg, plan.device)


def _close(trainer) -> None:
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    trainer.metrics.close()
    trainer.writer.close()
    destroy_num_microbatches_calculator()
    parallel_state.destroy_model_parallel()


def _iteration_syncs(plan: Plan, run_dir: Path, layers: int, micro: int):
    """(kind -> count, the sync records on the GPU) of one ordinary trainer iteration after a
    warm-up iteration."""
    from megatron_boost.testing.host_sync import CudaSyncRecorder, HostSyncCounter

    with contextlib.redirect_stdout(sys.stderr):  # the trainer's banner to the stage's log
        trainer = _trainer(plan, run_dir, layers, micro)
    try:
        trainer.iteration()  # warm-up: lazy optimizer state and buffers
        if plan.device == "cuda":
            with CudaSyncRecorder() as syncs:
                trainer.iteration()
            return syncs.counts(), syncs.records
        with HostSyncCounter() as counter:
            trainer.iteration()
        return dict(counter.counts), []
    finally:
        _close(trainer)


def stage_host_syncs(plan: Plan, work: Path) -> None:
    """The CUDA runtime's own count on the GPU (torch.cuda.set_sync_debug_mode: it sees syncs
    in C++ too, the backward engine's included), the Python-level counter on the CPU."""
    setup_stage(plan, groups=False)
    how = ("torch.cuda.set_sync_debug_mode('warn')" if plan.device == "cuda" else
           "HostSyncCounter (Python-level calls only; the CPU has no CUDA runtime)")
    info(4, "counted by", how)
    counts = {}
    for name, layers, micro in (("small", 1, 1), ("large", 3, 4)):
        counts[name], records = _iteration_syncs(plan, work / name, layers, micro)
        info(4, f"{name}: {layers} layers, {micro} micro-batches",
             f"{sum(counts[name].values())} host syncs per trainer iteration"
             + ("" if records else f" {counts[name]}"))  # by kind on the CPU
        for where, n in counts[name].items() if records else ():
            info(4, f"{name}: {n} x sync at", where)
        for i, record in enumerate(records):  # each sync's whole stack, to the stage's log
            print(f"--- stage 4 {name} sync {i + 1} ---\n{record.stack_text()}",
                  file=sys.stderr, flush=True)
    check(4, "constant per iteration", counts["small"] == counts["large"],
          f"{sum(counts['small'].values())} vs {sum(counts['large'].values())} "
          f"(must not grow with parameters or micro-batches)")
