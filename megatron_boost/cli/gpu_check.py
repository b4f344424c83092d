"""Readiness check of CUDA GPUs in one command (``tools/gpu_check.sh``), as stages.

    tools/gpu_check.sh                 # on the GPU machine
    tools/gpu_check.sh --cpu           # the same stages on the CPU at tiny shapes
    tools/gpu_check.sh --stages 0,3    # a selection

Every stage runs in a subprocess of its own with its own time limit (and the whole check under
``--deadline``), printing its rows as it measures them; a stage that fails, crashes or runs out
of time is a row, and the next stage still runs. Exit status 1 when any stage failed, 2 for bad
arguments. The stages are :mod:`megatron_boost.testing.gpu_training_stages` (0-2, 4: does
training work), :mod:`megatron_boost.testing.gpu_layout_stages` (3, 8: layouts against the
one-process reference), :mod:`megatron_boost.testing.gpu_measure` (5-7: how fast) and
:mod:`megatron_boost.testing.gpu_graph_stage` (9: CUDA graphs on = off), their
plans :mod:`megatron_boost.testing.gpu_stages`; the runner is
:mod:`megatron_boost.runtime.stages`; docs/gpu.md describes them all.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List

from megatron_boost.runtime import stages as runner
from megatron_boost.testing import (gpu_graph_stage, gpu_layout_stages, gpu_measure,
                                    gpu_stages, gpu_training_stages)
from megatron_boost.testing.gpu_stages import ROOT, RUN_ORDER, STAGE_NAMES, Plan

#: Test hooks (tests/test_gpu_check.py): the stage with this number raises at its start, or
#: sleeps past any limit, so the check's handling of a failing stage is exercised.
FAIL_STAGE_ENV = "MBOOST_GPU_CHECK_FAIL_STAGE"
HANG_STAGE_ENV = "MBOOST_GPU_CHECK_HANG_STAGE"

STAGES: Dict[int, Callable[[Plan, Path], None]] = {
    0: gpu_training_stages.stage_environment, 1: gpu_training_stages.stage_steps,
    2: gpu_training_stages.stage_resume, 3: gpu_layout_stages.stage_equivalence,
    8: gpu_layout_stages.stage_tensor_parallel, 4: gpu_training_stages.stage_host_syncs,
    5: gpu_measure.stage_throughput,
    6: gpu_measure.stage_attention, 7: gpu_measure.stage_layers,
    9: gpu_graph_stage.stage_cuda_graphs}
runner.STAGE_NAMES.update(STAGE_NAMES)


def run_stage(stage: int, plan: Plan, work: Path) -> int:
    """The body of one stage's subprocess: its rows on stdout; 0 when none failed."""
    if os.environ.get(FAIL_STAGE_ENV) == str(stage):
        runner.check(stage, "stage", False, f"made to fail by {FAIL_STAGE_ENV}={stage}")
        return 1
    if os.environ.get(HANG_STAGE_ENV) == str(stage):
        time.sleep(3600)
    try:
        STAGES[stage](plan, work)
    except Exception as err:
        traceback.print_exc()  # to the stage's log
        runner.check(stage, "stage", False, runner.one_line(err))
    return 1 if runner.failed_rows() else 0


def _stage_command(args: argparse.Namespace, work: Path) -> Callable[[int], List[str]]:
    return lambda stage: [sys.executable, "-m", "megatron_boost.cli.gpu_check", "--run-stage",
                          str(stage), "--workdir", str(work)] + (["--cpu"] if args.cpu else [])


def _stage_env(stage: int) -> Dict[str, str]:
    """The check's environment plus what the stage needs before torch starts."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(gpu_stages.stage_environment_variables(stage))
    return env


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu_check", description="Readiness check of CUDA GPUs as stages, each in its "
        "own process with its own time limit (docs/gpu.md).")
    parser.add_argument("--cpu", action="store_true",
                        help="run every stage on the CPU at tiny shapes (the suite's dry run)")
    parser.add_argument("--stages", default=",".join(map(str, RUN_ORDER)),
                        help="comma-separated stage numbers (default: all, run in the order "
                             f"{','.join(map(str, RUN_ORDER))})")
    parser.add_argument("--time-limit", action="append", default=[], metavar="STAGE=SECONDS",
                        help="override one stage's time limit (repeatable)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds for the whole check (default: 540 on the GPU)")
    parser.add_argument("--workdir", help="keep runs and stage logs here (default: a temporary "
                        "directory, kept when a stage fails)")
    parser.add_argument("--run-stage", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def print_summary(results: List[runner.StageResult], total: float) -> None:
    print(runner.stage_times(results, total), flush=True)
    failed = [r for r in results if r.status != "ok"]
    print(f"gpu_check: {len(results) - len(failed)}/{len(results)} stages ok"
          + ("" if not failed else "; not ok: " + ", ".join(f"{r.stage} ({r.status})"
                                                            for r in failed)), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = gpu_stages.cpu_plan() if args.cpu else gpu_stages.gpu_plan()
    if args.run_stage is not None:
        return run_stage(args.run_stage, plan, Path(args.workdir))
    try:
        chosen = runner.parse_stages(args.stages, RUN_ORDER)
        plan.limits.update(runner.parse_limits(args.time_limit))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    deadline = args.deadline or plan.deadline
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"gpu_check on {plan.device}: stages {','.join(map(str, chosen))}, deadline "
          f"{deadline:.0f} s, logs in {work}", flush=True)
    t0 = time.perf_counter()
    results = runner.run_stages(chosen, _stage_command(args, work), _stage_env, ROOT, work,
                                plan.limits, deadline)
    print_summary(results, time.perf_counter() - t0)
    ok = all(r.status == "ok" for r in results)
    if ok and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
