"""A checkpoint save the file system refuses is one line (megatron_boost/train/save_faults.py):
in-process on the error shapes that reach the trainer, and once end to end at TP=2 under the
README's launcher with a file-size limit (``RLIMIT_FSIZE``, SIGXFSZ ignored, set in the
launch's ``preexec_fn``) that the second run's first save exceeds; the run before it left a
complete checkpoint, which stays intact and committed."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import traceback
from pathlib import Path

import pytest

from megatron_boost.train import save_faults
from megatron_boost.train.checkpoint_guard import (
    TRACKER_FILE, commit_checkpoint, iter_dir_name, temp_dir_for, verify_manifest)
from megatron_boost.train.save_faults import explain_save_fault
from tests.test_bad_input import error_messages
from tests.test_training import DEBUG, ROOT, _env, run_training

TIMEOUT = 300


def _save_dir_with_a_complete_checkpoint(tmp_path: Path) -> Path:
    """A save directory whose tracker names a complete (fake) iteration 2, and the temp
    directory of iteration 4 half written."""
    final = tmp_path / iter_dir_name(2)
    temp = temp_dir_for(final)
    temp.mkdir(parents=True)
    (temp / "metadata.json").write_text("{}")
    commit_checkpoint(temp, final, 2)
    half = temp_dir_for(tmp_path / iter_dir_name(4))
    half.mkdir()
    (half / "__1_0.distcp").write_bytes(b"partial")
    return tmp_path


def _raised(err: BaseException) -> BaseException:
    """``err`` as raised (with a traceback, as torch wraps it)."""
    try:
        raise err
    except BaseException as caught:  # noqa: BLE001
        return caught


@pytest.mark.fast
def test_a_full_disk_names_the_file_and_the_intact_checkpoint(tmp_path):
    save = _save_dir_with_a_complete_checkpoint(tmp_path)
    shard = save / "iter_0000004.tmp" / "__0_0.distcp"
    cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(shard))
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = cause
    fault = explain_save_fault(wrapped, 4, temp_dir_for(save / iter_dir_name(4)), save)
    message = str(fault)
    assert "\n" not in message
    for part in ("iteration 4", str(shard), "no space left", "iteration 2", "is intact",
                 "run the same command again"):
        assert part in message, message


@pytest.mark.fast
@pytest.mark.parametrize("code,says", [(errno.EROFS, "read-only"),
                                       (errno.EACCES, "permission denied"),
                                       (errno.EFBIG, "file-size limit")])
def test_a_background_writers_failure_is_read_from_its_text(tmp_path, code, says):
    """megatron's writer sends its worker's OSError back as text inside torch's
    CheckpointException: the errno is read from it and the file written last is named."""
    from torch.distributed.checkpoint.api import CheckpointException

    save = _save_dir_with_a_complete_checkpoint(tmp_path)
    worker = _raised(RuntimeError(f"Worker failure: [Errno {code}] {os.strerror(code)}"))
    err = CheckpointException("write", {1: (worker, traceback.extract_tb(worker.__traceback__))})
    message = str(explain_save_fault(err, 4, temp_dir_for(save / iter_dir_name(4)), save))
    assert says in message and "__1_0.distcp" in message and "iteration 2" in message, message


@pytest.mark.fast
def test_a_short_write_without_an_errno_is_diagnosed(tmp_path, monkeypatch):
    """torch's zip writer says only ``unexpected pos``: with a file-size limit set, that is
    the cause named; with none (and space left), no cause is claimed."""
    save = _save_dir_with_a_complete_checkpoint(tmp_path)
    err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    temp = temp_dir_for(save / iter_dir_name(4))
    monkeypatch.setattr(save_faults, "_file_size_limit", lambda: 65536)
    assert "ulimit -f: 65536 bytes" in str(explain_save_fault(err, 4, temp, save))
    monkeypatch.setattr(save_faults, "_file_size_limit", lambda: None)
    assert "a write failed" in str(explain_save_fault(err, 4, temp, save))


@pytest.mark.fast
def test_other_errors_are_left_alone(tmp_path):
    save = _save_dir_with_a_complete_checkpoint(tmp_path)
    temp = temp_dir_for(save / iter_dir_name(4))
    for err in (RuntimeError("Connection closed by peer"), ValueError("bad"),
                FileNotFoundError(errno.ENOENT, "missing", "x")):
        assert explain_save_fault(err, 4, temp, save) is None


def _limit_file_size(limit: int):
    def preexec():
        os.setsid()  # its own session, as a terminal's foreground job (tests/test_fault_tolerance)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def test_a_save_past_the_file_size_limit_at_tp2_is_one_line_and_resumable(tmp_path):
    run = tmp_path / "run"
    common = ["parallel.tp=2", "checkpoint.save_interval=2", "training.eval_interval=1000",
              "training.train_iters=4", f"logging.run_dir={run}"]
    run_training(2, [*common, "training.exit_interval=2"])  # a complete checkpoint: iteration 2
    cmd = [str(ROOT / "scripts" / "run_local.sh"), "2", DEBUG, *common]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(_env(), PYTHONDONTWRITEBYTECODE="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_limit_file_size(32768))
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert proc.returncode == 1 and len(errors) == 1, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    (line,) = error_messages(errors)  # the first failing rank's: "error: rank 1: " is "error: "
    for part in ("error: checkpoint save of iteration 4 failed writing",
                 "iter_0000004.tmp", "file-size limit", "iteration 2", "is intact"):
        assert part in line, line
    ckpts = run / "checkpoints"
    assert (ckpts / TRACKER_FILE).read_text().strip() == "2"
    verify_manifest(ckpts / iter_dir_name(2))  # resuming from it is tests/test_fault_tolerance.py's
