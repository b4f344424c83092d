"""``megatron-boost-train`` / ``scripts/run_local.sh``: the launch command of the README.

    megatron-boost-train --nproc-per-node 2 --config run.yaml [section.key=value ...]
    scripts/run_local.sh 2 run.yaml [section.key=value ...]          # the same, from a clone

It validates first, in this one process (the configuration for the launch's world size, the
data against the tokenizer: ``pretrain_lowrank.py --check``), so a bad input ends in one
``error:`` line and exit status 2 before any rank starts. Then it is torchrun, in this process
(``torch.distributed.run.run``), with three differences a user at a terminal sees:

* **Errors are one line.** Ranks hand their ``error:`` line to the launcher through torchrun's
  per-rank error file (``cli/pretrain.py``); the launcher prints the first failing rank's line
  once and exits with that rank's status (2 for a usage error, 1 for a fault), instead of one
  line per rank and torchrun's ``ChildFailedError`` report.
* **Ctrl-C / SIGTERM / SIGUSR1 are a pre-emption.** The launcher, not torchrun, handles them: it
  forwards the signal to each rank, the ranks save at the next step boundary and exit 0, and so
  does the launcher. torchrun would raise its ``SignalException``, forward the signal once,
  SIGKILL the ranks after its shutdown timeout (30 s) and exit 1, whatever the ranks did.
  A second Ctrl-C stops at once: the launcher prints one line, SIGKILLs the ranks' sessions
  and exits 130; the last complete checkpoint stays in force.
* **torchrun's own log is quiet** (its shutdown warnings and failure records, up to ERROR):
  what the ranks print is the run's output.

Several nodes: the same command on every node with ``--nnodes N --node-rank K --rdzv-endpoint
HOST0:29500`` (c10d rendezvous); a configuration error is printed by node 0's launcher only
(every node checks the same configuration), and each node's launcher prints the first error of
its own ranks.
``scripts/slurm/pretrain.sbatch`` runs it once per node (adding ``--rdzv-id``, and ``--entry``
when PRETRAIN_SCRIPT names another trainer script, which is launched without the check: its
configuration is its own).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import List, Optional

from megatron_boost.cli.arg_types import non_negative_int, positive_int
from megatron_boost.cli.errors import USAGE_ERROR_EXIT_CODE, print_error
from megatron_boost.cli.pretrain import ERRORS_TO_LAUNCHER_ENV, check_launch
from megatron_boost.train.preemption import INTERRUPT_EXIT_CODE, PREEMPTION_SIGNALS

__all__ = ["main", "parse_args", "torchrun_args"]

#: The trainer's entry script, which torchrun starts once per rank.
ENTRY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "pretrain_lowrank.py")

#: Signals torchrun still handles itself (it forwards them and ends the ranks): the launcher
#: takes the pre-emption signals.
TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="megatron-boost-train",
        description="Validate a run, then train it on --nproc-per-node processes per node "
                    "(torchrun in this process): one error line, Ctrl-C saves and exits 0.",
        epilog="Overrides use dotted keys, e.g. parallel.tp=2 training.train_iters=100.")
    parser.add_argument("--nproc-per-node", type=positive_int, required=True,
                        help="processes on this node (GPUs, or CPU processes with gloo)")
    parser.add_argument("--nnodes", type=positive_int, default=1, help="nodes of the job")
    parser.add_argument("--node-rank", type=non_negative_int, default=0,
                        help="this node's index, 0 .. nnodes-1")
    parser.add_argument("--rdzv-endpoint", default=None,
                        help="HOST:PORT of node 0's rendezvous (required with --nnodes > 1)")
    parser.add_argument("--rdzv-id", default=None,
                        help="the job's rendezvous id, the same on every node (torchrun's)")
    parser.add_argument("--entry", default=ENTRY,
                        help="the trainer script torchrun starts on each rank (default: "
                             "pretrain_lowrank.py; another script is not checked first)")
    parser.add_argument("--config", required=True, help="YAML run configuration")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    if args.nnodes > 1 and not args.rdzv_endpoint:
        parser.error(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST0:PORT (node 0's "
                     f"address and a free port), the same on every node")
    if args.node_rank >= args.nnodes:
        parser.error(f"--node-rank {args.node_rank} must be below --nnodes {args.nnodes}")
    return args


def torchrun_args(args: argparse.Namespace) -> List[str]:
    """torchrun's command line for this launch (standalone on one node without an endpoint)."""
    if args.nnodes == 1 and not args.rdzv_endpoint:
        where = ["--standalone"]
    else:
        where = [f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}",
                 "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}"]
        if args.rdzv_id:
            where.append(f"--rdzv-id={args.rdzv_id}")
    return [*where, f"--nproc-per-node={args.nproc_per_node}",
            f"--signals-to-handle={TORCHRUN_SIGNALS}",
            args.entry, "--config", args.config, *args.overrides]


def _is_the_trainer(entry: str) -> bool:
    """Whether the entry is the project's trainer, whose configuration the launcher checks."""
    return os.path.basename(entry) == os.path.basename(ENTRY)


class _RankSignals:
    """Forwards the pre-emption signals to this process's ranks; a second Ctrl-C kills them."""

    def __init__(self):
        self.received: List[int] = []

    def install(self) -> None:
        import psutil  # noqa: F401 - imported here, not first inside a signal handler

        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, self.on_signal)

    def on_signal(self, signum, frame):  # noqa: ARG001 - signal handler signature
        again = signum == signal.SIGINT and signal.SIGINT in self.received
        self.received.append(signum)
        if again:
            from megatron_boost.train.preemption import interrupted_line

            print(interrupted_line(), file=sys.stderr, flush=True)
            self._send(signal.SIGKILL, whole_session=True)
        else:
            self._send(signum, whole_session=False)

    @property
    def stopped_at_once(self) -> bool:
        return self.received.count(signal.SIGINT) > 1

    @staticmethod
    def _send(signum: int, whole_session: bool) -> None:
        """To each rank: torchrun's children here, each the leader of its own session (a
        rank's own helper processes are in its session; a save's helper must not get the
        pre-emption signal, but dies with the rank on SIGKILL)."""
        import psutil  # imported before the handler was installed: no import in a handler

        for child in psutil.Process().children():
            try:
                if os.getsid(child.pid) != child.pid:
                    continue
                if whole_session:
                    os.killpg(child.pid, signum)
                else:
                    os.kill(child.pid, signum)
            except (ProcessLookupError, PermissionError, psutil.Error):
                pass  # exited meanwhile


def _node_index(args: argparse.Namespace) -> int:
    """This launcher's node: ``--node-rank``, or, in a Slurm step that leaves it to the c10d
    rendezvous (scripts/slurm/pretrain.sbatch), the step's node index ``SLURM_NODEID``. Every
    node validates the same configuration, so only node 0 prints a configuration error: one
    line for the job, not one per node (the others exit 2 quietly)."""
    if args.node_rank:
        return args.node_rank
    return int(os.environ.get("SLURM_NODEID", "0") or 0)


def _validate(args: argparse.Namespace) -> None:
    from megatron_boost.config.run import load_run_config

    cfg = load_run_config(args.config, args.overrides,
                          world_size=args.nproc_per_node * args.nnodes)
    check_launch(cfg)


def _failure_status(err) -> int:
    """Print the first failing rank's error line (torchrun's ``ChildFailedError``) once; its
    exit status."""
    rank, failure = err.get_first_failure()
    message = failure.message if isinstance(failure.message, str) else ""
    status = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
    if message.startswith("error:"):
        print(message, file=sys.stderr, flush=True)
    else:  # a crash: the rank printed its traceback above
        print(f"error: rank {rank} failed with exit status {status}; its traceback is above",
              file=sys.stderr, flush=True)
    return status


def main(argv: Optional[List[str]] = None) -> int:
    """Validate, then launch; the exit status of the run (0, 2 for bad input, 1 for a fault,
    130 after a second Ctrl-C)."""
    args = parse_args(argv)
    try:
        if _is_the_trainer(args.entry):
            _validate(args)
    except ValueError as err:
        if os.environ.get("MBOOST_TRACEBACK"):
            raise
        if _node_index(args) == 0:
            print_error(err)
        return USAGE_ERROR_EXIT_CODE
    except KeyboardInterrupt:
        print("error: interrupted before the launch; nothing was started", file=sys.stderr)
        return INTERRUPT_EXIT_CODE
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args as torchrun_parse_args
    from torch.distributed.run import run as torchrun

    logging.disable(logging.ERROR)  # torchrun's log in this process (the ranks are others)
    if args.nproc_per_node > 1:  # torchrun's default, without its warning
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # docs/design.md §10.12
    os.environ[ERRORS_TO_LAUNCHER_ENV] = "1"
    signals = _RankSignals()
    signals.install()
    try:
        torchrun(torchrun_parse_args(torchrun_args(args)))
    except ChildFailedError as err:
        if signals.stopped_at_once:
            return INTERRUPT_EXIT_CODE
        return _failure_status(err)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
