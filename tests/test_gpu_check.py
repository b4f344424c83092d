"""tools/gpu_check.sh: its per-rank shapes and GEMM list, the CUDA sync recorder's reporting,
and the whole check as a CPU dry run (every stage runs; a stage made to fail or to hang prints
its row and the next stage runs; the comparisons fail under their negative controls)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_boost.analysis.flops import (MODEL_FLOPS_CAUSAL, attention_core_flops,
                                          forward_flops_per_token)
from megatron_boost.analysis.rank_shape import (projection_gemms, projection_training_flops,
                                               rank_layout_problem, rank_local_shape)
from megatron_boost.config.shape import ModelShape
from megatron_boost.cli import gpu_check
from megatron_boost.cli.gpu_check import FAIL_STAGE_ENV, HANG_STAGE_ENV, STAGES
from megatron_boost.config.run import load_run_config
from megatron_boost.testing import gpu_measure
from megatron_boost.testing.gpu_stages import NEGATIVE_CONTROL_ENV, cpu_plan

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tools" / "gpu_check.sh")
COLA_7B = ModelShape.from_config(load_run_config(str(ROOT / "configs" / "cola-7b.yaml")),
                                 "cola-7b")


@pytest.mark.parametrize("mode,expected", [
    # full: megatron shards heads and ffn; the hidden stream stays whole
    ("full", dict(hidden=4096, ffn=2752, heads=8, attn_rank=1024, mlp_rank=1024)),
    # naive: A column- and B row-parallel shard the ranks; attention and MLP are replicated
    ("naive", dict(hidden=4096, ffn=11008, heads=32, attn_rank=256, mlp_rank=256)),
    # boost: hidden stream, heads and ffn sharded; the full rank r on every rank
    ("boost", dict(hidden=1024, ffn=2752, heads=8, attn_rank=1024, mlp_rank=1024)),
])
def test_rank_local_shapes_at_tp4(mode, expected):
    local = rank_local_shape(COLA_7B, mode, 4)
    got = {k: getattr(local, k) for k in expected}
    assert got == expected and local.e == 128 and local.g == local.heads


def test_rank_local_query_groups_under_gqa():
    gqa = ModelShape("gqa", num_layers=1, hidden=4096, ffn=11008, heads=32, query_groups=8,
                     attn_rank=1024, mlp_rank=1024)
    assert [rank_local_shape(gqa, mode, 4).g for mode in ("full", "naive", "boost")] == [2, 8, 2]


def test_a_layout_the_trainer_refuses_is_a_reason_not_a_shape():
    """cola-1b's ffn (5461) does not divide by 2: full and boost shard it, naive does not.
    The reason is the trainer's own rule (config/modes.py check_tp_split)."""
    cola_1b = ModelShape.from_config(load_run_config(str(ROOT / "configs" / "cola-1b.yaml")),
                                     "cola-1b")
    for mode in ("full", "boost"):
        why = rank_layout_problem(cola_1b, mode, 2)
        assert why.startswith("ffn_hidden_size (5461) must be divisible by "
                              "tensor_model_parallel_size (2)"), why
        with pytest.raises(ValueError, match="5461"):
            rank_local_shape(cola_1b, mode, 2)
    assert rank_layout_problem(cola_1b, "naive", 2) is None


def test_tp_stage_layouts_follow_the_gpus_it_finds():
    """Stage 8's worlds: two gloo processes on the CPU or one GPU; NCCL with DP=2 from two GPUs;
    a world of four with DP and PP from four. Every spec compares after a few steps."""
    from megatron_boost.testing.gpu_layout_stages import tensor_parallel_layouts
    from megatron_boost.testing.gpu_stages import COMPARISON_STEPS

    def shape(device, gpus):
        return [(world, backend, [(s.layout.mode, s.layout.tp, s.layout.pp,
                                  world // (s.layout.tp * s.layout.pp)) for s in specs])
                for world, backend, specs in tensor_parallel_layouts(device, gpus, None)]

    at_tp2 = [("boost", 2, 1, 1), ("naive", 2, 1, 1), ("full", 2, 1, 1)]
    assert shape("cpu", 0) == shape("cuda", 1) == [(2, "gloo", at_tp2)]
    assert shape("cuda", 2) == [(2, "nccl", at_tp2 + [("boost", 1, 1, 2)])]
    assert shape("cuda", 8) == [(2, "nccl", at_tp2 + [("boost", 1, 1, 2)]),
                                (4, "nccl", [("boost", 2, 1, 2), ("boost", 2, 2, 1)])]
    specs = [s for _, _, ss in tensor_parallel_layouts("cuda", 4, "collective") for s in ss]
    assert all(s.steps == COMPARISON_STEPS and s.drop_tp_all_reduce and not s.corrupt
               for s in specs)


def test_sync_recorder_reports_each_sync_with_its_python_stack():
    """The path a GPU run's sync warnings take, fed torch's warning text directly (a CPU build
    has no CUDA runtime to warn): each sync is one record whose stack names the caller; any
    other warning is shown as before."""
    import warnings

    from megatron_boost.testing.host_sync import SYNC_WARNING, CudaSyncRecorder

    def reads_the_device():
        warnings.warn(f"{SYNC_WARNING} (Triggered internally at CUDAFunctions.cpp)",
                      UserWarning)

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with CudaSyncRecorder() as syncs:
            for _ in range(2):  # the same call site twice
                reads_the_device()
            warnings.warn("an unrelated warning", UserWarning)
    assert [str(w.message) for w in shown] == ["an unrelated warning"]
    assert len(syncs.records) == 2
    assert syncs.records[0].stack[-1].name == "reads_the_device"
    where = syncs.records[0].where()
    assert where.startswith("tests/test_gpu_check.py:") and "reads_the_device" in where
    assert syncs.counts() == {where: 2}
    assert "reads_the_device" in syncs.records[0].stack_text()


def test_gemm_list_carries_the_analytic_projection_flops():
    """3 GEMMs (forward, input and weight gradient) of 2·T·k·n per factor add up to 3 × the
    shape's forward projection FLOPs, which are analysis.flops' per-token count of a one-layer
    model without its attention core and head."""
    tokens = 8192
    for mode in ("full", "naive", "boost"):
        local = rank_local_shape(COLA_7B, mode, 2)
        gemm_flops = sum(3 * 2 * tokens * k * n for k, n in projection_gemms(local, mode))
        assert gemm_flops == projection_training_flops(local, mode, tokens)
        one_layer = dataclasses.replace(local, num_layers=1)
        per_token = forward_flops_per_token(one_layer, mode, vocab_size=0, seq_length=2048) \
            - attention_core_flops(2048, local.heads, local.e, causal=MODEL_FLOPS_CAUSAL)
        assert gemm_flops == pytest.approx(3 * tokens * per_token, rel=1e-12)


def test_out_of_memory_is_a_row_and_other_errors_fail(monkeypatch, capsys):
    """Stage 6 in-process with the layer run replaced: OOM reports a row (not a failure), any
    other error a FAIL row; te on the CPU an 'unavailable' row."""
    import torch

    def run(plan, case, backend):
        if backend == "sdpa":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 GiB")
        raise RuntimeError("broken kernel")

    monkeypatch.setattr(gpu_measure, "setup_stage", lambda plan: None)
    monkeypatch.setattr(gpu_measure, "_attention_case", run)
    gpu_measure.stage_attention(cpu_plan(), Path("."))
    rows = {line.split("s=128 ")[1].split()[0]: line  # backend -> row
            for line in capsys.readouterr().out.splitlines()}
    assert re.search(r"\bn/a\s+unavailable: Transformer Engine needs CUDA", rows["te"])
    assert re.search(r"\binfo\s+out of memory: OutOfMemoryError", rows["sdpa"])
    assert re.search(r"\bFAIL\s+RuntimeError: broken kernel", rows["local"])


@pytest.mark.fast
def test_a_stages_cases_run_one_after_the_other_whatever_each_does(capsys):
    """run_cases, every stage's loop: a case that cannot run is an n/a row and is not run, one
    that raises is a FAIL row and the next still runs, and each case is set up only when the
    one before it has finished (the cases are read lazily)."""
    from megatron_boost.testing.gpu_stages import Case, run_cases

    ran = []

    def broken():
        ran.append("broken")
        raise RuntimeError("broken kernel")

    def cases():
        yield Case("unavailable", lambda: ran.append("unavailable"), "unavailable: no TE")
        yield Case("broken", broken)
        ran.append("set up last")  # only after "broken" has run and failed
        yield Case("last", lambda: ran.append("last"))

    run_cases(1, cases(), "cpu")
    rows = capsys.readouterr().out.splitlines()
    assert ran == ["broken", "set up last", "last"]
    case = slice(len("[0] ") + 13, len("[0] ") + 13 + 40)  # the case column (see _status)
    assert [(r[case].strip(), _status(r)) for r in rows] == [("unavailable", "n/a"),
                                                              ("broken", "FAIL")]
    assert rows[0].endswith("unavailable: no TE") and rows[1].endswith("RuntimeError: broken "
                                                                       "kernel")


def _fake_resume_worlds(monkeypatch, failing=()):
    """run_distributed of stage 8's save/resume replaced: each call's modes recorded; a world
    holding a mode of ``failing`` raises as a failed spawned world does, any other gives rank 0
    bitwise-equal resumed losses per mode."""
    from megatron_boost.runtime import spawn

    worlds = []

    def run_distributed(fn, world, plan, work, modes, attention, device, backend):
        worlds.append(list(modes))
        if set(modes) & set(failing):
            raise RuntimeError("distributed worker failed:\n--- rank 1 ---\nbroken save")
        ref = {i: {"loss": 5.0 - i / 10} for i in range(1, 7)}
        return [[(ref, {i: ref[i] for i in (4, 5, 6)}) for _ in modes], [({}, {})] * len(modes)]

    monkeypatch.setattr(spawn, "run_distributed", run_distributed)
    return worlds


def _resume_rows(out: str):
    return {r.split("TP=2")[1].split(" tp=2")[0].strip(): _status(r)
            for r in _stage_rows(out, 8) if "save/resume" in r}


def test_tp_resume_runs_both_modes_in_one_world(monkeypatch, capsys, tmp_path):
    """Stage 8's save/resume starts its two ranks once for naive and full (a rank's start-up
    costs more than a debug run), each mode still its own row."""
    from megatron_boost.testing import gpu_layout_stages

    worlds = _fake_resume_worlds(monkeypatch)
    gpu_layout_stages._tp_resume(cpu_plan(), tmp_path, 2, "gloo")
    assert worlds == [["naive", "full"]]
    assert _resume_rows(capsys.readouterr().out) == {"naive": "ok", "full": "ok"}


def test_a_failed_resume_world_reruns_each_mode_alone(monkeypatch, capsys, tmp_path):
    """When the shared world fails, each mode runs in a world of its own: the failing mode has
    its FAIL row and the other mode still its ok row."""
    from megatron_boost.testing import gpu_layout_stages

    worlds = _fake_resume_worlds(monkeypatch, failing=("naive",))
    gpu_layout_stages._tp_resume(cpu_plan(), tmp_path, 2, "gloo")
    assert worlds == [["naive", "full"], ["naive"], ["full"]]
    rows = _resume_rows(capsys.readouterr().out)
    assert rows == {"naive": "FAIL", "full": "ok"}, rows


def test_the_check_imports_without_torch():
    """The check's module imports no torch: every process that imports it without measuring
    stays light (the coordinator, a stage made to fail or to hang, stage 9 on the CPU, and the
    helper process megatron's checkpoint writer spawns in a stage or a stage's rank, which
    re-imports the check as its main module)."""
    code = ("import sys; import megatron_boost.cli.gpu_check; "
            "heavy = [m for m in ('torch', 'megatron.core') if m in sys.modules]; "
            "assert not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_bad_stage_selection_is_one_error_line(capsys):
    assert gpu_check.main(["--cpu", "--stages", "0,99"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --stages '0,99' must be a comma-separated list")


#: The script's two runs here: (arguments, extra environment) by the test that reads it.
RUNS = {
    # the clean run in two halves at once: each half runs its stages one at a time
    "test_cpu_dry_run_every_stage_passes": (["--cpu", "--stages", "0,1,2,3,8"], {}),
    "test_cpu_dry_run_every_stage_passes/measuring": (["--cpu", "--stages", "4,9,5,6,7"], {}),
    # one run for every way a stage fails: made to fail, hanging, and the comparisons of
    # stages 3 and 8 under a perturbed weight and a dropped collective
    "test_a_failing_and_a_hanging_stage_do_not_stop_the_next": (
        ["--cpu", "--stages", "0,1,3,8,5", "--time-limit", "1=1"],
        {FAIL_STAGE_ENV: "0", HANG_STAGE_ENV: "1",
         NEGATIVE_CONTROL_ENV: "3=weight,8=collective"}),
}


def _start(args, work, env_extra):
    env = {k: v for k, v in os.environ.items()
           if k not in (FAIL_STAGE_ENV, HANG_STAGE_ENV, NEGATIVE_CONTROL_ENV)}
    env.update(PYTHON=sys.executable, **env_extra)
    return subprocess.Popen([SCRIPT, *args, "--workdir", str(work)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def script_runs(request, tmp_path_factory):
    """The selected tests' runs of the script, started together: the check runs one stage at a
    time on one thread, so the second run's stages use a core the first leaves idle. Each test
    collects its own run (with a deadline); any still running at the end is killed."""
    selected = {item.name for item in request.session.items}
    procs = {name: _start(args, tmp_path_factory.mktemp("gpu_check"), env_extra)
             for name, (args, env_extra) in RUNS.items() if name.split("/")[0] in selected}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)


def _result(script_runs, name, timeout=1800):
    out, err = script_runs[name].communicate(timeout=timeout)
    return subprocess.CompletedProcess(script_runs[name].args, script_runs[name].returncode,
                                       out, err)


def _stage_rows(out: str, stage: int):
    return [line for line in out.splitlines() if line.startswith(f"[{stage}] ")]


def _comparisons(out: str, stage: int):
    """The comparison rows (logits, gradients, loss and updates) of a stage."""
    return [r for r in _stage_rows(out, stage)
            if re.search(r" (logits|gradients|loss, updates) ", r)]


def _status(line: str) -> str:
    """The status column of a row (after the 40-wide case column)."""
    return line[len("[0] ") + 13 + 41:].split()[0]


def test_cpu_dry_run_every_stage_passes(script_runs):
    halves = [_result(script_runs, name) for name in RUNS if name.startswith(
        "test_cpu_dry_run_every_stage_passes")]
    for proc in halves:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    out = "".join(proc.stdout for proc in halves)
    for stage in STAGES:
        rows = _stage_rows(out, stage)
        assert rows and "-- stage --" in rows[-1] and _status(rows[-1]) == "ok", (stage, out)
        assert all(_status(r) in ("ok", "info", "n/a") for r in rows), (stage, rows)
    # stage 1: 3 modes x 3 backends; te is reported unavailable on the CPU, never passed
    steps = _stage_rows(out, 1)[:-1]
    assert len(steps) == 9 and sum(_status(r) == "ok" for r in steps) == 6
    assert all("unavailable:" in r for r in steps if " / te " in r)
    assert sum("(bitwise)" in r for r in _stage_rows(out, 2)) == 2  # dist-opt on and off
    for stage in (3, 8):  # fp32 with TF32 off, every comparison ok after the steps
        math_mode = _stage_rows(out, stage)[0]
        assert "IEEE fp32" in math_mode and _status(math_mode) == "ok", math_mode
    assert len(_comparisons(out, 3)) == 3  # boost vs naive: logits, gradients, loss+updates
    assert len(_comparisons(out, 8)) == 3 * 3  # boost, naive, full at TP=2
    assert "2 processes" in "".join(_stage_rows(out, 8)) and "gloo" in out
    assert sum("tp=2 save/resume" in r and "(bitwise)" in r for r in _stage_rows(out, 8)) == 2
    assert "constant per iteration" in "".join(_stage_rows(out, 4))
    # stage 5 ran the override's 3 steps, not cola-350m.yaml's token budget
    assert sum("3 steps (1 warm-up)" in r for r in _stage_rows(out, 5)) == 2
    # (debug shape at tp 1, 2) x 3 modes, each its timing row and its op ledger's row
    # and the jit_fuser row, n/a on the CPU
    assert len(_stage_rows(out, 7)) == 2 + 2 * 3 * 2
    assert "no GPU" in [r for r in _stage_rows(out, 7) if "jit_fuser" in r][0]
    ledger_rows = [r for r in _stage_rows(out, 7) if "op ledger:" in r]
    assert len(ledger_rows) == 6 and all("profiler: n/a (no GPU)" in r for r in ledger_rows)
    # stage 9 (CUDA graphs) is CUDA-only: one n/a row saying so
    graph_rows = _stage_rows(out, 9)[:-1]
    assert len(graph_rows) == 1 and _status(graph_rows[0]) == "n/a", graph_rows
    assert "no GPU" in graph_rows[0]
    assert out.count("gpu_check: 5/5 stages ok") == 2
    # the per-stage times, in the run order (stages 0-3 and the TP stage first)
    times = [t for line in re.findall(r"^stage times: (.*)$", out, re.M)
             for t in line.split(" | ")[:-1]]
    assert [int(t.split()[0]) for t in times] == [0, 1, 2, 3, 8, 4, 9, 5, 6, 7]


def test_a_failing_and_a_hanging_stage_do_not_stop_the_next(script_runs):
    proc = _result(script_runs, "test_a_failing_and_a_hanging_stage_do_not_stop_the_next")
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr[-3000:]
    fail, fail_stage = _stage_rows(out, 0)
    assert _status(fail) == "FAIL" and f"made to fail by {FAIL_STAGE_ENV}=0" in fail
    assert _status(fail_stage) == "FAIL"
    (hang,) = _stage_rows(out, 1)
    assert _status(hang) == "TIMEOUT" and "killed after its limit of 1 s" in hang
    for stage in (3, 8):  # each comparison prints FAIL under its negative control
        rows = _comparisons(out, stage)
        assert len(rows) == 3 * (1 if stage == 3 else 3), out
        assert all(_status(r) == "FAIL" for r in rows), rows
    rows = _stage_rows(out, 5)
    assert len(rows) == 3 and all(_status(r) == "ok" for r in rows), out
    assert "not ok: 0 (FAIL), 1 (TIMEOUT), 3 (FAIL), 8 (FAIL)" in out


def _processes_naming(text: str):
    """pids whose command line contains ``text``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ") \
                if proc.name.isdigit() else b""
            if text in cmdline.decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:  # the process ended meanwhile
            continue
    return pids


def test_sigterm_of_the_check_kills_the_running_stage(tmp_path):
    """An outer timeout (SIGTERM) must not leave a stage running on a lent GPU."""
    import signal
    import time

    env = {**os.environ, HANG_STAGE_ENV: "1"}
    env.pop(FAIL_STAGE_ENV, None)
    work = str(tmp_path / "sigterm")
    check_proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_boost.cli.gpu_check", "--cpu", "--stages", "1",
         "--workdir", work], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not _processes_naming(f"--run-stage 1 --workdir {work}"):
            assert time.monotonic() < deadline, "the stage never started"
            time.sleep(0.2)
        check_proc.send_signal(signal.SIGTERM)
        check_proc.wait(timeout=30)
        time.sleep(0.5)
        assert _processes_naming(work) == []
    finally:
        check_proc.kill()
        for pid in _processes_naming(work):  # this test's own stage, when the check failed
            os.kill(pid, signal.SIGKILL)
