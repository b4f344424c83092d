"""A checkpoint save that the file system refuses, as one line (docs/fault-tolerance.md).

A full disk, a quota, the file-size limit (``ulimit -f``), a file system remounted read-only
or a permission taken away during a save reaches the trainer in many shapes: an ``OSError``
from our own commit, torch.distributed.checkpoint's ``CheckpointException`` holding each rank's
failure (megatron's background writers send theirs back as ``RuntimeError("Worker failure:
[Errno 27] File too large")``, the errno and file name lost), or torch's zip writer's
``[enforce fail at inline_container.cc:...] unexpected pos`` with no errno at all (and, on a rank
whose own writes went through, a ``CheckpointException`` holding no failure).
:func:`explain_save_fault` finds the cause in any of them and returns a
:class:`CheckpointSaveFailed` whose message names the file, the cause and its fix, and says
that the last complete checkpoint is intact (the commit protocol never moves the tracker to an
incomplete one, train/checkpoint_guard.py) and that the same command resumes from it. Any other
error is left as it is.
"""

from __future__ import annotations

import errno
import logging
import re
import resource
import shutil
from pathlib import Path
from typing import Iterator, Optional, Tuple

from megatron_boost.train.checkpoint_guard import read_tracker

__all__ = ["CheckpointSaveFailed", "explain_save_fault", "quiet_writer_failure_logs"]

#: Errno of a refused write -> what happened and what to do about it ({limit}: ulimit -f).
_FIXES = {
    errno.ENOSPC: ("no space left on the device", "free space on that file system"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space or raise the quota"),
    errno.EFBIG: ("the file reached the file-size limit (ulimit -f: {limit})",
                  "raise or remove the limit"),
    errno.EROFS: ("the file system is read-only", "make it writable again"),
    errno.EACCES: ("permission denied", "make the checkpoint directory writable for you"),
    errno.EPERM: ("operation not permitted", "make the checkpoint directory writable for you"),
}
_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]")
#: torch's zip writer (torch.save) reports a short write without an errno.
_SHORT_WRITE = re.compile(r"unexpected pos|file write failed", re.IGNORECASE)
_LOW_SPACE = 1 << 20


#: megatron's background writer logs its worker's failure (``Local process 0 encountered an
#: error: ...``) before raising it; the raised error is what :func:`explain_save_fault` reports.
_WRITER_LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"


class _DropWorkerFailure(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "encountered an error" not in record.getMessage()


def quiet_writer_failure_logs() -> None:
    """Drop the log line megatron's writer prints for a worker's failure: the same failure is
    raised to the trainer, which reports it (once, in one line)."""
    logger = logging.getLogger(_WRITER_LOGGER)
    if not any(isinstance(f, _DropWorkerFailure) for f in logger.filters):
        logger.addFilter(_DropWorkerFailure())


class CheckpointSaveFailed(Exception):
    """A save the file system refused; the message is the one line to print (exit status 1:
    a fault, not bad input)."""


def _causes(err: BaseException) -> Iterator[BaseException]:
    """``err`` and every exception reachable from it: causes, contexts, and the per-rank
    failures a torch.distributed.checkpoint ``CheckpointException`` holds."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for _, failure in sorted(failures.items(), key=lambda kv: str(kv[0])):
                failure = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(failure, BaseException):
                    todo.append(failure)


def _write_fault(err: BaseException) -> Optional[Tuple[Optional[int], Optional[str]]]:
    """(errno or None, file name or None) of the refused write behind ``err``; None when it
    is no such fault. An ``OSError`` wins, then an errno in a message, then a write known to
    have failed without one."""
    in_text, without_errno = None, False
    for e in _causes(err):
        if isinstance(e, OSError) and e.errno in _FIXES:
            return e.errno, e.filename
        match = _ERRNO_IN_TEXT.search(str(e))
        if match and int(match.group(1)) in _FIXES:
            in_text = in_text or int(match.group(1))
        # torch.distributed.checkpoint on a rank whose own writes went through while another
        # rank's failed raises a CheckpointException holding no failure: diagnosed alike
        empty = type(e).__name__ == "CheckpointException" and not getattr(e, "failures", None)
        without_errno = without_errno or empty or bool(_SHORT_WRITE.search(str(e)))
    if in_text is not None:
        return in_text, None
    return (None, None) if without_errno else None


def _file_size_limit() -> Optional[int]:
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def _diagnose_short_write(directory: Path) -> Optional[int]:
    """The errno a write that failed without one most likely had: the file-size limit when
    one is set, a full disk when little space is left; None when neither."""
    if _file_size_limit() is not None:
        return errno.EFBIG
    try:
        if shutil.disk_usage(directory).free < _LOW_SPACE:
            return errno.ENOSPC
    except OSError:
        pass
    return None


def _newest_file(directory: Path) -> Path:
    """The file of ``directory`` written last (the one a failed write was writing), else the
    directory itself."""
    try:
        files = [p for p in directory.rglob("*") if p.is_file()]
    except OSError:
        files = []
    return max(files, key=lambda p: p.stat().st_mtime_ns) if files else directory


def _last_complete(save_dir: Path) -> Optional[int]:
    try:
        return read_tracker(save_dir)
    except (ValueError, OSError):
        return None


def explain_save_fault(err: BaseException, iteration: int, temp: Path,
                       save_dir: Path) -> Optional[CheckpointSaveFailed]:
    """The one-line :class:`CheckpointSaveFailed` for ``err`` raised while saving
    ``iteration`` into ``temp`` (under ``save_dir``); None when ``err`` is no refused write."""
    fault = _write_fault(err)
    if fault is None:
        return None
    code, name = fault
    if code is None:
        code = _diagnose_short_write(save_dir)
    what, fix = _FIXES.get(code, ("a write failed", "check the file system (space, "
                                                     "ulimit -f, permissions)"))
    limit = _file_size_limit()
    what = what.format(limit=f"{limit} bytes" if limit is not None else "unlimited")
    where = Path(name) if name else _newest_file(Path(temp))
    last = _last_complete(Path(save_dir))
    resume = (f"the last complete checkpoint, iteration {last} in {save_dir}, is intact: "
              f"{fix}, then run the same command again to resume from it" if last is not None
              else f"no checkpoint of this run was complete yet, so none is lost: {fix}, "
                   f"then run the same command again (it starts from the beginning)")
    return CheckpointSaveFailed(f"checkpoint save of iteration {iteration} failed writing "
                                f"{where}: {what}; {resume}")

