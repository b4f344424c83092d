"""One owner per run directory (docs/fault-tolerance.md): a lock file taken by rank 0 at start.

Two launches into one run directory would write one ``metrics.jsonl`` and one checkpoint
directory side by side, and the second one's first save would delete the first one's save in
flight (a leftover ``iter_N.tmp`` is removed by the next save). So rank 0 creates
``<dir>/run.lock`` before anything is written there (for the run directory, and for
``checkpoint.save`` when it lies outside it), with ``O_CREAT | O_EXCL``: atomic on local file
systems and on NFS v3+, Lustre and GPFS, where ``flock`` may be a no-op. The file holds the
owner's host, pid, start time, the process's identity (boot id and start tick, so a pid reused
after a reboot or by another program is not taken for the owner) and the Slurm job id and
restart count. It is removed when the run ends (an exception included); a run killed with
SIGKILL leaves it, and the next launch decides whether its owner is gone:

* the owner's host is this host: gone when no process with its pid and identity runs (or it
  is this very process: a previous run in it, e.g. a notebook);
* another host: gone when it was an earlier start of this Slurm job (the same
  ``SLURM_JOB_ID``, another ``SLURM_RESTART_COUNT``: a requeue, maybe onto another node);
* otherwise it may be alive: the launch is refused in one line naming the owner and the fix.

A gone owner's lock is taken over, and that is said in one line. Two launches taking over the
same stale lock at the same instant: the rename of the stale file is atomic, and the launch
whose renamed file is not the one it judged stale puts it back and is refused.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import List, Optional

__all__ = ["LOCK_FILE", "RunLock", "owner_record"]

LOCK_FILE = "run.lock"


def _process_identity(pid: int) -> Optional[str]:
    """``<boot id>:<start tick>`` of a running process (Linux), else None (no such process,
    or no /proc to read)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is parenthesised and may hold spaces: split after it
    return f"{boot}:{stat.rsplit(')', 1)[1].split()[19]}"


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def owner_record(pid: Optional[int] = None) -> dict:
    """What a lock file holds for process ``pid`` (this one by default) on this host."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "pid": pid,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "identity": _process_identity(pid), "token": uuid.uuid4().hex,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID") or None,
            "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)}


def _describe(owner: dict) -> str:
    job = f", Slurm job {owner['slurm_job_id']}" if owner.get("slurm_job_id") else ""
    return (f"host {owner.get('host')} pid {owner.get('pid')} (started "
            f"{owner.get('started')}{job})")


def _gone_because(owner: dict) -> Optional[str]:
    """Why the owner of a lock no longer runs, or None when it may."""
    job = os.environ.get("SLURM_JOB_ID")
    if owner.get("host") == socket.gethostname():
        pid = owner.get("pid")
        if not isinstance(pid, int):
            return "its pid is not a number"
        identity = _process_identity(pid)
        if pid == os.getpid() and identity == owner.get("identity"):
            return "it is this process: an earlier run in it"
        if not _pid_runs(pid) or (identity is not None and owner.get("identity") is not None
                                  and identity != owner.get("identity")):
            return "no such process runs on this host"
        return None
    if job and owner.get("slurm_job_id") == job and owner.get("slurm_restart_count") != \
            int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0):
        return f"it was an earlier start of this Slurm job {job} (requeued)"
    return None


def _read(path: Path) -> Optional[dict]:
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: a lock nonetheless, of an unknown owner
    return record if isinstance(record, dict) else {}


class RunLock:
    """The locks of one run's directories, held by rank 0 (see the module docstring)."""

    def __init__(self):
        self.record = owner_record()
        self.held: List[Path] = []

    def acquire(self, directories, say=print) -> None:
        """Lock every directory (each exists); ``ValueError`` (one line) when another live
        launch owns one, after releasing those already taken. ``say`` gets the one line of a
        takeover."""
        dirs = list(dict.fromkeys(Path(d).resolve() for d in directories))
        # a directory inside another of the list (<run_dir>/checkpoints) is covered by it
        dirs = [d for d in dirs if not any(o != d and o in d.parents for o in dirs)]
        try:
            for d in dirs:
                self._acquire_one(d / LOCK_FILE, say)
        except BaseException:
            self.release()
            raise

    def _acquire_one(self, path: Path, say) -> None:
        for _ in range(3):  # create; else judge the owner, take a gone one's over, create again
            if self._create(path):
                self.held.append(path)
                return
            owner = _read(path)
            if owner is None:  # released meanwhile
                continue
            why = _gone_because(owner) if owner else None
            if why is None:
                raise ValueError(self._refusal(path, owner))
            self._take_over(path, owner)
            say(f"{path.parent}: taking over {LOCK_FILE} of {_describe(owner)}: {why}")
        raise ValueError(f"{path} keeps reappearing: another launch is starting in "
                         f"{path.parent} at the same moment; launch one only")

    def _create(self, path: Path) -> bool:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.record, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    @staticmethod
    def _take_over(path: Path, owner: dict) -> None:
        """Move the stale lock aside (atomic); if what moved is not the lock judged stale,
        another launch took over first: put its lock back and refuse."""
        aside = path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        if _read(aside) != owner:
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
            os.unlink(aside)
            raise ValueError(f"{path.parent}: another launch took over its {LOCK_FILE} at the "
                             f"same moment; launch one only")
        os.unlink(aside)

    @staticmethod
    def _refusal(path: Path, owner: dict) -> str:
        where = (f"run directory {path.parent} is in use by {_describe(owner)}" if owner else
                 f"run directory {path.parent} has a lock file {path} that cannot be read")
        if owner and owner.get("host") == socket.gethostname():
            return (f"{where}, which still runs: wait for it to end or stop it, or use another "
                    f"logging.run_dir")
        return (f"{where}, on another host, which may still run: stop it or use another "
                f"logging.run_dir; if you know it is gone (its node crashed), remove {path} "
                f"and launch again")

    def release(self) -> None:
        """Remove the lock files this process still owns (another's, after a takeover of a
        lock it judged gone, stay)."""
        for path in reversed(self.held):
            owner = _read(path)
            if owner and owner.get("token") == self.record["token"]:
                try:
                    path.unlink()
                except OSError:
                    pass
        self.held = []
