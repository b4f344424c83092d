"""Checks run as stages, each in a process group of its own with its own time limit
(``tools/gpu_check.sh``, docs/gpu.md).

A stage prints its rows the moment each is measured (:func:`check`, :func:`info`,
:func:`emit`); :func:`run_stages` starts the stages one after the other under a deadline, kills
a stage's whole process group at its limit, and reports a stage that fails, crashes or runs out
of time as a row while the next stage still runs. SIGTERM (an outer ``timeout``) or Ctrl-C of
the runner kills the running stage's group, so no stage outlives the check.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Sequence

__all__ = ["Row", "StageResult", "emit", "check", "info", "one_line", "failed_rows",
           "run_stages", "stage_times", "parse_stages", "parse_limits"]


@dataclass
class Row:
    stage: int
    case: str
    status: str  # ok | FAIL | TIMEOUT | SKIPPED | info | n/a
    result: str


#: Stage number -> its name in the rows (set by the check that runs the stages).
STAGE_NAMES: Dict[int, str] = {}


def format_row(row: Row) -> str:
    name = STAGE_NAMES.get(row.stage, "")
    return f"[{row.stage}] {name:<12} {row.case:<40} {row.status:<7} {row.result}"


#: FAIL rows printed by this process (a stage's exit status).
_failed = [0]


def failed_rows() -> int:
    return _failed[0]


def emit(row: Row) -> Row:
    """Print a row now (a stage's stdout is the check's stdout)."""
    _failed[0] += row.status == "FAIL"
    print(format_row(row), flush=True)
    return row


def check(stage: int, case: str, ok: bool, result: str) -> Row:
    return emit(Row(stage, case, "ok" if ok else "FAIL", result))


def info(stage: int, case: str, result: str) -> Row:
    return emit(Row(stage, case, "info", result))


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


@dataclass
class StageResult:
    stage: int
    status: str  # ok | FAIL | TIMEOUT | SKIPPED
    seconds: float
    reason: str = ""


def _last_log_line(log: Path) -> str:
    lines = [l for l in log.read_text(errors="replace").splitlines() if l.strip()] \
        if log.exists() else []
    return lines[-1].strip()[:200] if lines else "no output"


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill a stage's process group (the stage and anything it started) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


#: While a stage is being started, SIGTERM only marks itself pending (_launch raises it once
#: the stage's handle exists).
_termination = {"deferred": False, "pending": False}


def _terminate(signum, frame):
    """SIGTERM (e.g. an outer ``timeout``) as an exception, so the running stage is killed."""
    if _termination["deferred"]:
        _termination["pending"] = True
        return
    raise SystemExit(128 + signum)


def _launch(stage: int, cmd: List[str], cwd: Path, env: Mapping[str, str], log: Path,
            limit: float) -> StageResult:
    """Run one stage in its own process group; kill the group after ``limit`` seconds."""
    t0 = time.perf_counter()
    with open(log, "w") as err:
        _termination["deferred"] = True  # until the stage's handle exists to kill it by
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, env=dict(env), stderr=err,
                                    start_new_session=True)
        finally:
            _termination["deferred"] = False
        try:
            if _termination["pending"]:
                raise SystemExit(128 + signal.SIGTERM)
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return StageResult(stage, "TIMEOUT", time.perf_counter() - t0,
                               f"killed after its limit of {limit:.0f} s; log {log}")
        except BaseException:  # Ctrl-C, or SIGTERM (_terminate): no stage outlives the check
            _kill_group(proc)
            raise
    seconds = time.perf_counter() - t0
    with contextlib.suppress(ProcessLookupError):  # leftovers (e.g. checkpoint writers)
        os.killpg(proc.pid, signal.SIGKILL)
    if rc == 0:
        return StageResult(stage, "ok", seconds)
    if rc == 1:
        return StageResult(stage, "FAIL", seconds, f"a row failed; log {log}")
    return StageResult(stage, "FAIL", seconds, f"exit {rc}: {_last_log_line(log)}; log {log}")


def run_stages(stages: Sequence[int], command: Callable[[int], List[str]],
               environment: Callable[[int], Mapping[str, str]], cwd: Path, work: Path,
               limits: Mapping[int, float], deadline: float) -> List[StageResult]:
    """Each stage's ``command`` in its own process (stderr to ``work/stage<N>.log``), at most
    its limit and never past the deadline; a ``-- stage --`` row after each."""
    signal.signal(signal.SIGTERM, _terminate)
    t0 = time.perf_counter()
    results = []
    for stage in stages:
        left = deadline - (time.perf_counter() - t0)
        if left < 5:
            result = StageResult(stage, "SKIPPED", 0.0,
                                 f"no time left of the {deadline:.0f} s deadline")
        else:
            result = _launch(stage, command(stage), cwd, environment(stage),
                             work / f"stage{stage}.log", min(limits[stage], left))
        results.append(result)
        emit(Row(stage, "-- stage --", result.status, f"{result.seconds:.1f} s"
                 + (f" | {result.reason}" if result.reason else "")))
    return results


def stage_times(results: Sequence[StageResult], total: float) -> str:
    return "stage times: " + " | ".join(
        f"{r.stage} {STAGE_NAMES.get(r.stage, '')} {r.seconds:.1f} s" for r in results) \
        + f" | total {total:.1f} s"


def parse_stages(text: str, known: Sequence[int]) -> List[int]:
    """Stage numbers of ``--stages``, in the order of ``known`` (the run order)."""
    try:
        chosen = {int(s) for s in text.split(",") if s.strip()}
    except ValueError:
        chosen = {-1}
    if not chosen or not chosen <= set(known):
        raise ValueError(f"--stages {text!r} must be a comma-separated list of stage numbers "
                         f"{min(known)}-{max(known)} (e.g. --stages 0,3)")
    return [s for s in known if s in chosen]


def parse_limits(items: Sequence[str]) -> Dict[int, float]:
    limits = {}
    for item in items:
        stage, _, seconds = item.partition("=")
        try:
            limits[int(stage)] = float(seconds)
        except ValueError:
            raise ValueError(f"--time-limit {item!r} must look like STAGE=SECONDS "
                             f"(e.g. --time-limit 5=120)") from None
    return limits
