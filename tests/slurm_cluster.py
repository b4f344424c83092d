"""A private, real Slurm cluster on this machine, for tests (not a pytest test file).

Starts ``munged``, ``slurmctld`` and one or two ``slurmd`` as root, with every key, socket,
state, spool, pid and log file in a private temporary directory, so launch scripts can be
tested against the real scheduler. Facts behind the configuration: docs/design.md §12.

    ok, why = slurm_available(nodes=2)
    with SlurmCluster(nodes=2) as cluster:
        rc, job_id = cluster.sbatch("scripts/slurm/pretrain.sbatch", ["cfg.yaml"],
                                    extra_sbatch_args=["--nodes=2"], env={"NPROC_PER_NODE": "1"})
        print(cluster.run(["squeue"]).stdout)

* ``nodes=1``: one node named ``localhost`` (the machine's hostname is not ``localhost``, hence
  ``slurmd -N``).
* ``nodes=2``: nodes ``n1`` and ``n2`` (NodeHostname=localhost, NodeAddr=127.0.0.1, distinct
  ports). Node names do not resolve by themselves, so a process holding a private mount
  namespace (``unshare -m --propagation private``) bind-mounts a hosts file mapping n1/n2 to
  127.0.0.1 over /etc/hosts, and every daemon *and* every client command (sbatch, squeue,
  scontrol, ...) runs in that namespace through ``nsenter -t <holder> -m``. Jobs are started by
  slurmd and inherit it, so ``scontrol show hostnames`` + ``getent hosts n1`` work in jobs.
* Fixed ports (16817 for slurmctld, 16818.. for slurmd): one cluster per machine at a time,
  enforced with a file lock in ``/tmp/megatron-boost-slurm`` (waits ``lock_timeout`` seconds,
  then fails with a clear message). Daemons left behind by a killed earlier session are found
  through the pid record next to the lock and stopped by PID.
* ``stop()`` cancels jobs, stops every daemon by PID (SIGTERM, then SIGKILL), also every job
  process that carries this cluster's marker in its environment, and removes the state dir
  (``keep_state=True`` keeps it for debugging).

Also here: ``SlurmClusterPool`` (reuse one cluster across tests; one at a time) and
``launcher_env()`` (a job environment for scripts/slurm/pretrain.sbatch).

Every client command gets ``SLURM_CONF`` (plus a marker variable) and loses any ``SLURM_*``,
``SBATCH_*``, ``SRUN_*`` and ``SALLOC_*`` variables inherited from the calling environment.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

__all__ = [
    "SlurmCluster",
    "SlurmClusterError",
    "SlurmClusterPool",
    "TERMINAL_STATES",
    "launcher_env",
    "slurm_available",
]

CTLD_PORT = 16817
SLURMD_BASE_PORT = 16818
LOCK_DIR = Path("/tmp/megatron-boost-slurm")
MARKER_VAR = "MEGATRON_BOOST_SLURM_CLUSTER"

TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "SPECIAL_EXIT",
        "REVOKED",
    }
)

_SEARCH_PATH = os.pathsep.join(
    [os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
)
_DAEMONS = ("munged", "slurmctld", "slurmd")
_CLIENTS = ("sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
_NS_TOOLS = ("unshare", "nsenter", "mount")


class SlurmClusterError(RuntimeError):
    pass


def _which(name: str) -> str | None:
    return shutil.which(name, path=_SEARCH_PATH)


def slurm_available(nodes: int = 1) -> tuple[bool, str]:
    """(True, "") when a private cluster with ``nodes`` nodes can be started here, else
    (False, reason). Needs root, munged, slurmctld, slurmd and the Slurm clients; for more than
    one node also unshare, nsenter and mount (util-linux)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return False, "Slurm test cluster needs Linux"
    if os.geteuid() != 0:
        return False, "Slurm test cluster needs root (daemons run as SlurmUser=root)"
    needed = list(_DAEMONS) + list(_CLIENTS) + (list(_NS_TOOLS) if nodes > 1 else [])
    missing = [n for n in needed if _which(n) is None]
    if missing:
        return False, (
            "Slurm not installed (missing: " + ", ".join(missing) + "); install with "
            "`apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge`"
        )
    return True, ""


def _clean_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for k in list(env):
        if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")):
            del env[k]
    env["PATH"] = _SEARCH_PATH
    return env


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"<{path}: {e.strerror}>"
    return "\n".join(text[-lines:])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is not alive for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _proc_mentions(pid: int, needle: str) -> bool:
    """Whether process ``pid``'s command line or environment contains ``needle``."""
    for name in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                if needle.encode() in f.read():
                    return True
        except OSError:
            pass
    return False


def _port_in_use(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("0.0.0.0", port))
    except OSError as e:
        return e.errno == errno.EADDRINUSE
    finally:
        s.close()
    return False


def _kill_pids(pids: Iterable[int], grace: float = 5.0) -> None:
    """SIGTERM each pid, wait up to ``grace`` seconds, then SIGKILL what is left."""
    pids = [p for p in pids if p > 1 and p != os.getpid()]
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
        time.sleep(0.1)
    for p in pids:
        if _pid_alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


class SlurmCluster:
    """A private Slurm cluster (context manager). See the module docstring.

    Args:
        nodes: 1 (node ``localhost``) or 2 (nodes ``n1``, ``n2``).
        cpus_per_node: CPUs each node advertises to the scheduler (allocation only; the machine
            may have fewer).
        lock_timeout: seconds to wait for another cluster on this machine to go away.
        start_timeout: seconds to wait for every node to be idle.
        extra_conf: extra lines appended to slurm.conf (before the node lines).
        keep_state: keep the state directory (logs, spool) after ``stop()``.
        namespace: run in a private mount namespace with n1/n2 in /etc/hosts; default: nodes>1.
        cred_expire: job credential lifetime (AuthInfo cred_expire), which is also the delay
            before a requeued job may start again (Slurm's default: 120 s).
    """

    def __init__(
        self,
        nodes: int = 1,
        cpus_per_node: int = 2,
        *,
        lock_timeout: float = 120.0,
        start_timeout: float = 30.0,
        extra_conf: Sequence[str] = (),
        keep_state: bool = False,
        namespace: bool | None = None,
        cred_expire: int = 5,
    ) -> None:
        if nodes not in (1, 2):
            raise ValueError("nodes must be 1 or 2")
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node
        self.lock_timeout = lock_timeout
        self.start_timeout = start_timeout
        self.extra_conf = list(extra_conf)
        self.keep_state = keep_state
        self.use_namespace = nodes > 1 if namespace is None else namespace
        self.cred_expire = cred_expire
        self.node_names = ["localhost"] if nodes == 1 else ["n1", "n2"]

        self.state_dir: Path | None = None
        self.conf_path: Path | None = None
        self.munge_socket: Path | None = None
        self._lock_fd: int | None = None
        self._procs: dict[str, subprocess.Popen] = {}  # name -> daemon process
        self._ns_pid: int | None = None
        self._started = False
        self.last_sbatch: subprocess.CompletedProcess | None = None  # for debugging

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "SlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "SlurmCluster":
        ok, why = slurm_available(self.nodes if self.use_namespace else 1)
        if not ok:
            raise SlurmClusterError(why)
        self._acquire_lock()
        try:
            self._cleanup_stale()
            busy = [p for p in self._ports() if _port_in_use(p)]
            if busy:
                raise SlurmClusterError(
                    f"ports {busy} are in use: another Slurm (not started by SlurmCluster, or "
                    "started from another mount of /tmp) is running on this machine"
                )
            self.state_dir = Path(tempfile.mkdtemp(prefix="mboost-slurm-"))
            self.conf_path = self.state_dir / "slurm.conf"
            self.munge_socket = self.state_dir / "munge" / "munge.socket"
            self._write_files()
            if self.use_namespace:
                self._start_namespace()
            self._start_munge()
            self._start_daemon(
                "slurmctld", ["slurmctld", "-D", "-f", str(self.conf_path)]
            )
            for name in self.node_names:
                self._start_daemon(
                    f"slurmd-{name}", ["slurmd", "-D", "-f", str(self.conf_path), "-N", name]
                )
            self._wait_idle()
            self._started = True
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel all jobs, stop every daemon and job process of this cluster by PID, release
        the lock. Safe to call more than once."""
        try:
            if self._procs.get("slurmctld") is not None and self._procs["slurmctld"].poll() is None:
                try:
                    self.cancel_all(timeout=3)
                except Exception:
                    pass
            order = [n for n in self._procs if n.startswith("slurmd")] + ["slurmctld", "munged"]
            for name in order:
                proc = self._procs.get(name)
                if proc is not None and proc.poll() is None:
                    _kill_pids([proc.pid])
                if proc is not None:
                    try:
                        proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
            # job processes (slurmstepd, batch shells, srun, trainers) carry the marker
            if self.state_dir is not None:
                _kill_pids(self._marked_pids(), grace=2.0)
            if self._ns_pid is not None:
                holder = self._procs.get("ns-holder")
                _kill_pids([self._ns_pid], grace=2.0)
                if holder is not None:
                    try:
                        holder.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
                self._ns_pid = None
            for proc in self._procs.values():
                for stream in (proc.stdout, proc.stderr):
                    if stream is not None:
                        stream.close()
            self._procs.clear()
            if self.state_dir is not None and not self.keep_state:
                shutil.rmtree(self.state_dir, ignore_errors=True)
        finally:
            self._started = False
            self._release_lock()

    # ------------------------------------------------------------------ client API
    @property
    def env(self) -> dict[str, str]:
        """Environment for client commands and jobs: caller's env minus SLURM_* etc., plus
        SLURM_CONF and the cluster marker."""
        self._require_state()
        env = _clean_env()
        env["SLURM_CONF"] = str(self.conf_path)
        env[MARKER_VAR] = str(self.state_dir)
        return env

    def command(self, cmd: Sequence[str], cwd: str | os.PathLike | None = None) -> list[str]:
        """``cmd`` prefixed so it runs inside the cluster's mount namespace (if any), in
        directory ``cwd`` (default: the current one; entering a mount namespace would otherwise
        reset it to /)."""
        cmd = list(cmd)
        if self._ns_pid is not None:
            wd = os.path.abspath(cwd if cwd is not None else os.getcwd())
            return ["nsenter", "-t", str(self._ns_pid), "-m", f"--wd={wd}", "--"] + cmd
        return cmd

    def run(
        self,
        cmd: Sequence[str] | str,
        *,
        env: Mapping[str, str | None] | None = None,
        cwd: str | os.PathLike | None = None,
        timeout: float | None = 60,
        check: bool = False,
        input: str | None = None,
    ) -> subprocess.CompletedProcess:
        """Run a client command (squeue, scontrol, scancel, sinfo, or any program; a string is
        run by ``sh -c``) with SLURM_CONF set, inside the cluster's namespace. ``env`` entries
        are added to :attr:`env` (``None`` removes a variable). Returns CompletedProcess with
        text stdout/stderr."""
        if isinstance(cmd, str):
            cmd = ["sh", "-c", cmd]
        full_env = self.env
        for k, v in (env or {}).items():
            if v is None:
                full_env.pop(k, None)
            else:
                full_env[k] = str(v)
        r = subprocess.run(
            self.command(cmd, cwd),
            env=full_env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
        )
        if check and r.returncode != 0:
            raise SlurmClusterError(
                f"{shlex.join(cmd)} exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
            )
        return r

    def sbatch(
        self,
        script: str | os.PathLike,
        args: Sequence[str] = (),
        wait: bool = True,
        extra_sbatch_args: Sequence[str] = (),
        env: Mapping[str, str | None] | None = None,
        *,
        cwd: str | os.PathLike | None = None,
        timeout: float = 120.0,
    ) -> tuple[int, int]:
        """Submit ``script args...`` with sbatch and return ``(returncode, job_id)``.

        ``wait=True``: wait until the job has finished, through requeues, and return its exit
        code (``ExitCode`` status, or 128 + the signal that ended it), like ``sbatch --wait``
        but polled every 0.25 s: ``sbatch --wait`` itself sleeps 2 s between its polls.
        After ``timeout`` seconds the job is cancelled and SlurmClusterError is raised with
        the job's and daemons' state. ``wait=False``: the return code is sbatch's own.
        ``extra_sbatch_args`` go before the script (e.g. ``--nodes=2``, ``--output=...``);
        ``env`` is added to the submitting environment, which the job inherits (sbatch's
        default --export=ALL); ``cwd`` is the submit directory (SLURM_SUBMIT_DIR, where
        relative --output paths land)."""
        deadline = time.monotonic() + timeout
        cmd = ["sbatch", "--parsable"] + list(extra_sbatch_args)
        cmd += [str(script)] + [str(a) for a in args]
        r = self.run(cmd, env=env, cwd=cwd, timeout=timeout)
        job_id = self._parse_job_id(r.stdout)
        if job_id is None:
            raise SlurmClusterError(
                f"sbatch gave no job id (rc={r.returncode})\nstdout:\n{r.stdout}\nstderr:\n"
                f"{r.stderr}\n{self.log_tails()}"
            )
        self.last_sbatch = r
        if not wait or r.returncode != 0:
            return r.returncode, job_id
        try:
            info = self.wait_job(job_id, timeout=max(deadline - time.monotonic(), 1.0), poll=0.25)
        except SlurmClusterError as e:
            self.run(["scancel", str(job_id)], timeout=10)
            raise SlurmClusterError(f"job {job_id} did not finish within {timeout}s "
                                    f"(cancelled)\n{e}") from None
        status, _, sig = info.get("ExitCode", "1:0").partition(":")
        return (128 + int(sig) if sig and int(sig) else int(status)), job_id

    def cancel_all(self, timeout: float = 15.0) -> bool:
        """scancel every job and wait up to ``timeout`` s for the queue to empty (True if it
        did). Useful between tests sharing one cluster."""
        self.run(["scancel", "--quiet", "--user=root"], timeout=15)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.run(["squeue", "-h", "-o", "%i"], timeout=15)
            if r.returncode != 0 or not r.stdout.strip():
                return True
            time.sleep(0.2)
        return False

    def job_info(self, job_id: int | str) -> dict[str, str] | None:
        """``scontrol show job -o`` as a dict (JobState, ExitCode, Restarts, NodeList, ...), or
        None once Slurm has forgotten the job (MinJobAge=300 s after it ends)."""
        r = self.run(["scontrol", "show", "job", "-o", str(job_id)], timeout=15)
        if r.returncode != 0 or not r.stdout.strip():
            return None
        info: dict[str, str] = {}
        for m in re.finditer(r"(\S+?)=(\S*)", r.stdout.splitlines()[0]):
            info.setdefault(m.group(1), m.group(2))
        return info

    def job_state(self, job_id: int | str) -> str | None:
        """The job's state (PENDING, RUNNING, COMPLETED, FAILED, ...) or None if unknown."""
        info = self.job_info(job_id)
        return None if info is None else info.get("JobState")

    def wait_state(
        self,
        job_id: int | str,
        states: Iterable[str] = TERMINAL_STATES,
        timeout: float = 60.0,
        poll: float = 0.2,
    ) -> dict[str, str]:
        """Poll until the job is in one of ``states``; return its job_info. Raises
        SlurmClusterError on timeout or if the job disappears first."""
        states = set(states)
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if info is None:
                raise SlurmClusterError(
                    f"job {job_id} vanished while waiting for {sorted(states)} (last: {last})"
                )
            last = info.get("JobState")
            if last in states:
                return info
            time.sleep(poll)
        raise SlurmClusterError(
            f"job {job_id} not in {sorted(states)} after {timeout}s (state {last})\n"
            f"{self.describe_job(job_id)}\n{self.log_tails()}"
        )

    def wait_job(self, job_id: int | str, timeout: float = 60.0, poll: float = 0.2) -> dict[str, str]:
        """Wait until the job has finished (terminal state); return its job_info."""
        return self.wait_state(job_id, TERMINAL_STATES, timeout=timeout, poll=poll)

    def job_pids(self) -> list[int]:
        """PIDs of this cluster's job processes (slurmstepd, batch shells, srun, the job's own
        processes): those that carry its marker, less its daemons."""
        self._require_state()
        daemons = {p.pid for p in self._procs.values()}
        return [pid for pid in self._marked_pids() if pid not in daemons]

    def describe_job(self, job_id: int | str | None) -> str:
        if job_id is None:
            return ""
        r = self.run(["scontrol", "show", "job", str(job_id)], timeout=15)
        return f"scontrol show job {job_id}:\n{r.stdout}{r.stderr}"

    def log_tails(self, lines: int = 30) -> str:
        """The last lines of every daemon log, for error messages."""
        if self.state_dir is None:
            return ""
        parts = []
        for path in sorted((self.state_dir / "log").glob("*")):
            parts.append(f"--- {path.name} ---\n{_tail(path, lines)}")
        return "\n".join(parts)

    # ------------------------------------------------------------------ internals
    def _ports(self) -> list[int]:
        return [CTLD_PORT] + [SLURMD_BASE_PORT + i for i in range(len(self.node_names))]

    def _require_state(self) -> None:
        if self.state_dir is None or self.conf_path is None:
            raise SlurmClusterError("cluster not started")

    @staticmethod
    def _parse_job_id(out: str) -> int | None:
        for line in out.splitlines():
            m = re.match(r"^\s*(?:Submitted batch job )?(\d+)(?:;\S+)?\s*$", line)
            if m:
                return int(m.group(1))
        return None

    def _acquire_lock(self) -> None:
        LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(LOCK_DIR / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + self.lock_timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    try:
                        holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
                    except OSError:
                        holder = "?"
                    os.close(fd)
                    raise SlurmClusterError(
                        "another SlurmCluster is running on this machine (fixed ports "
                        f"{CTLD_PORT}+; lock {LOCK_DIR / 'lock'} held by pid {holder}); waited "
                        f"{self.lock_timeout}s"
                    ) from None
                time.sleep(0.25)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is None:
            return
        try:
            (LOCK_DIR / "daemons.json").unlink(missing_ok=True)
        except OSError:
            pass
        try:
            os.ftruncate(self._lock_fd, 0)
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _record_pids(self) -> None:
        record = {
            "owner": os.getpid(),
            "state_dir": str(self.state_dir),
            "pids": {name: p.pid for name, p in self._procs.items()},
        }
        tmp = LOCK_DIR / "daemons.json.tmp"
        tmp.write_text(json.dumps(record))
        tmp.replace(LOCK_DIR / "daemons.json")

    def _cleanup_stale(self) -> None:
        """We hold the lock, so a daemons.json left behind belongs to a session that died
        without stop(): stop its daemons and job processes (identified by PID and by its state
        directory in their command line / environment)."""
        path = LOCK_DIR / "daemons.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        state_dir = record.get("state_dir") or ""
        if state_dir and state_dir.startswith(tempfile.gettempdir()):
            pids = [int(p) for p in record.get("pids", {}).values() if _proc_mentions(int(p), state_dir)]
            pids += self._marked_pids(state_dir)
            _kill_pids(sorted(set(pids)))
            shutil.rmtree(state_dir, ignore_errors=True)
        path.unlink(missing_ok=True)

    def _marked_pids(self, state_dir: str | None = None) -> list[int]:
        """PIDs of processes whose command line or environment names this cluster's state
        directory (daemons, slurmstepd, job shells, srun, job processes)."""
        needle = state_dir or str(self.state_dir)
        me = os.getpid()
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != me and _proc_mentions(int(entry), needle):
                out.append(int(entry))
        return out

    def _write_files(self) -> None:
        d = self.state_dir
        assert d is not None
        for sub in ("munge", "log", "ctld", "spool", "run"):
            (d / sub).mkdir(mode=0o700)
        os.chmod(d, 0o711)
        os.chmod(d / "munge", 0o711)  # munged wants its socket directory searchable by all
        for n in self.node_names:
            (d / "spool" / n).mkdir(mode=0o700)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        if self.nodes == 1:
            node_lines = [
                f"NodeName=localhost NodeAddr=127.0.0.1 Port={SLURMD_BASE_PORT} "
                f"CPUs={self.cpus_per_node} State=UNKNOWN"
            ]
        else:
            node_lines = [
                f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 "
                f"Port={SLURMD_BASE_PORT + i} CPUs={self.cpus_per_node} State=UNKNOWN"
                for i, n in enumerate(self.node_names)
            ]
        conf = [
            "ClusterName=mboosttest",
            "SlurmctldHost=localhost",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also sets how long a requeued job waits before it may start again
            # (default 120 s; 5 is the least Slurm 22.05 accepts: a smaller value means 120)
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}",
            f"SlurmctldPort={CTLD_PORT}",
            f"SlurmdPort={SLURMD_BASE_PORT}",
            f"StateSaveLocation={d / 'ctld'}",
            f"SlurmdSpoolDir={d / 'spool'}/%n",
            f"SlurmctldPidFile={d / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            # start jobs (e.g. requeued ones reaching their EligibleTime) within ~1 s
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            "ReturnToService=2",
            # a finished job stays visible to scontrol for 5 min, so a poll that comes late
            # (a loaded machine) still reads its state and exit code
            "MinJobAge=300",
            "KillWait=10",
            "InactiveLimit=0",
            "JobRequeue=1",
            *self.extra_conf,
            *node_lines,
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf_path.write_text("\n".join(conf) + "\n")
        if self.use_namespace:
            try:
                orig = Path("/etc/hosts").read_text()
            except OSError:
                orig = "127.0.0.1 localhost\n"
            if not orig.endswith("\n"):
                orig += "\n"
            hosts = d / "hosts"
            hosts.write_text(orig + "127.0.0.1 " + " ".join(self.node_names) + "\n")
            os.chmod(hosts, 0o644)

    def _daemon_env(self) -> dict[str, str]:
        return self.env

    def _start_namespace(self) -> None:
        assert self.state_dir is not None
        hosts = self.state_dir / "hosts"
        ready = self.state_dir / "run" / "ns-ready"
        script = (
            f"mount --bind {shlex.quote(str(hosts))} /etc/hosts && "
            f"getent hosts {self.node_names[0]} > {shlex.quote(str(ready))} && exec sleep 2147483647"
        )
        proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
            env=self._daemon_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._procs["ns-holder"] = proc
        self._ns_pid = proc.pid
        self._record_pids()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                self._ns_pid = None
                raise SlurmClusterError(
                    f"could not set up a private mount namespace (unshare -m / mount --bind "
                    f"over /etc/hosts) exit {proc.returncode}: {out}"
                )
            if ready.exists() and ready.stat().st_size > 0:
                return
            time.sleep(0.05)
        raise SlurmClusterError("mount namespace holder did not become ready within 10 s")

    def _start_munge(self) -> None:
        d = self.state_dir
        assert d is not None
        self._start_daemon(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={d / 'munge' / 'munge.key'}",
                f"--pid-file={d / 'run' / 'munged.pid'}",
                f"--log-file={d / 'log' / 'munged.log'}",
                f"--seed-file={d / 'munge' / 'munged.seed'}",
            ],
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._procs["munged"].poll() is not None:
                raise SlurmClusterError(
                    f"munged exited with {self._procs['munged'].returncode}\n{self._daemon_output('munged')}\n"
                    + self.log_tails()
                )
            if self.munge_socket.exists():
                return
            time.sleep(0.05)
        raise SlurmClusterError("munged did not create its socket within 10 s\n" + self.log_tails())

    def _start_daemon(self, name: str, cmd: list[str]) -> None:
        assert self.state_dir is not None
        out = open(self.state_dir / "log" / f"{name}.stdout", "wb")
        try:
            proc = subprocess.Popen(
                self.command(cmd, self.state_dir),
                env=self._daemon_env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.state_dir,
                start_new_session=True,
            )
        finally:
            out.close()
        self._procs[name] = proc
        self._record_pids()

    def _daemon_output(self, name: str) -> str:
        assert self.state_dir is not None
        return _tail(self.state_dir / "log" / f"{name}.stdout")

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        last = ""
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise SlurmClusterError(
                        f"{name} exited with {proc.returncode} during startup\n" + self.log_tails()
                    )
            r = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=15)
            last = (r.stdout + r.stderr).strip()
            states = dict(line.split()[:2] for line in r.stdout.splitlines() if len(line.split()) >= 2)
            if r.returncode == 0 and all(states.get(n) == "idle" for n in self.node_names):
                return
            time.sleep(0.2)
        raise SlurmClusterError(
            f"nodes not idle after {self.start_timeout}s; last sinfo: {last!r}\n" + self.log_tails()
        )


class SlurmClusterPool:
    """Holds at most one cluster (ports are fixed) and reuses it for consecutive requests with
    the same node count; meant for a module- or session-scoped pytest fixture:

        @pytest.fixture(scope="session")
        def slurm_pool():
            pool = SlurmClusterPool()
            yield pool
            pool.close()
    """

    def __init__(self, **cluster_kwargs) -> None:
        self.cluster_kwargs = cluster_kwargs
        self.current: SlurmCluster | None = None

    def get(self, nodes: int = 1) -> SlurmCluster:
        if self.current is not None and self.current.nodes == nodes and self.current._started:
            return self.current
        self.close()
        self.current = SlurmCluster(nodes=nodes, **self.cluster_kwargs).start()
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


# Variables of the calling environment that change what scripts/slurm/pretrain.sbatch does.
LAUNCHER_ENV_VARS = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "NPROC_PER_NODE", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PRETRAIN_SCRIPT", "TORCHRUN",
    "PYTHON_ENV", "PET_SIGNALS_TO_HANDLE", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "REQUEUE_ON_PREEMPT",
    "MBOOST_DEVICE", "SRUN_ARGS", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA",
    "NCCL_IB_DISABLE", "NCCL_IB_GID_INDEX", "NCCL_NET", "NCCL_CROSS_NIC", "NCCL_SOCKET_FAMILY",
    "NCCL_DEBUG", "UCX_NET_DEVICES", "FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "SLURM_EXPORT_ENV",
)


def launcher_env(
    pretrain_script: str | os.PathLike | None = None, **overrides: str | None
) -> dict[str, str | None]:
    """An ``env`` for :meth:`SlurmCluster.sbatch` of scripts/slurm/pretrain.sbatch: clears the
    launcher's variables inherited from the caller, runs torchrun as ``<this python> -m
    torch.distributed.run``, activates this interpreter's venv (PYTHON_ENV) when it is one,
    and uses ``pretrain_script`` as the entry point if given. ``overrides`` win (None
    removes a variable), e.g. ``launcher_env(trainer, NPROC_PER_NODE="2")``."""
    import sys

    env: dict[str, str | None] = {k: None for k in LAUNCHER_ENV_VARS}
    env["TORCHRUN"] = f"{sys.executable} -m torch.distributed.run"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if sys.prefix != sys.base_prefix and (Path(sys.prefix) / "bin" / "activate").exists():
        env["PYTHON_ENV"] = sys.prefix
    if pretrain_script is not None:
        env["PRETRAIN_SCRIPT"] = str(pretrain_script)
    env.update(overrides)
    return env
