"""``pretrain_lowrank.py`` / ``megatron-boost-pretrain``: parse, validate once, train.

    torchrun --nproc_per_node=2 pretrain_lowrank.py --config configs/debug.yaml parallel.tp=2
    python pretrain_lowrank.py --config configs/debug.yaml        # one process, no torchrun
    python pretrain_lowrank.py --check --world-size 2 --config ...  # validate only (launchers)

A ``ValueError`` raised before training starts (configuration, data, layout, checkpoint) ends
the process with one line, ``error: <message>`` on stderr, and exit status 2; a fault during
training (too many consecutive non-finite steps, an unresponsive rank, a checkpoint save the
file system refuses: train/save_faults.py) with one such line and
status 1 (``MBOOST_TRACEBACK=1`` shows the traceback). Any other error during training,
``ValueError`` included, is not a usage error: it ends in its traceback (status 1). Every
rank prints the error it raised, a rank other than 0 naming itself (``error: rank 1: ...``):
torchrun ends the other ranks as soon as one exits, so a line left to rank 0 alone could be
lost when another rank got there first. Under the project's launcher (``cli/launch.py``,
which sets ``MBOOST_ERRORS_TO_LAUNCHER``) a rank writes that line to torchrun's per-rank error
file instead, and the launcher prints the first failing rank's line, once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import List, Optional, Sequence

from megatron_boost.cli.arg_types import positive_int
from megatron_boost.cli.errors import USAGE_ERROR_EXIT_CODE, print_error
from megatron_boost.train.resilience import RankTimeout, TrainingDiverged
from megatron_boost.train.save_faults import CheckpointSaveFailed

__all__ = ["main", "parse_args", "select_device", "CONFIG_ERROR_EXIT_CODE", "FAULT_EXIT_CODE"]

#: Exit status for configuration / usage errors (``error: ...`` on stderr).
CONFIG_ERROR_EXIT_CODE = USAGE_ERROR_EXIT_CODE
#: Exit status when training stops on a fault: too many non-finite steps, an unresponsive rank.
FAULT_EXIT_CODE = 1


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pretrain_lowrank.py",
        description="Pretrain a low-rank bottleneck LLM (CoLA) with megatron-core and BOOST's "
                    "bottleneck-aware tensor parallelism.",
        epilog="Overrides use dotted keys, e.g. parallel.tp=2 training.train_iters=100 "
               "model.attn_rank=64 (values parsed as YAML). Launch several processes with "
               "torchrun --nproc_per_node=N.")
    parser.add_argument("--config", required=True, help="YAML run configuration")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--check", action="store_true",
                        help="validate the configuration and its data files for --world-size "
                             "processes, then exit without training or writing anything (the "
                             "local launchers run this before torchrun, so a bad input ends in "
                             "one error line rather than torchrun's failure report)")
    parser.add_argument("--world-size", type=positive_int, default=None,
                        help="with --check: the number of processes of the launch "
                             "(default: $WORLD_SIZE or 1)")
    return parser.parse_args(argv)


def check_launch(cfg) -> Optional[int]:
    """What can be checked without process groups: the dataset files against the tokenizer
    (the configuration itself was validated when it was loaded). Returns the tokenizer's
    vocabulary, when the run reads one."""
    from megatron_boost.data.datasets import build_tokenizer
    from megatron_boost.data.validation import validate_data_files

    if cfg.data.tokenizer_model and not cfg.data.mock:
        vocab = int(build_tokenizer(cfg.data).vocab_size)
        validate_data_files(cfg.data, vocab)
        return vocab
    return None


def check_passed_line(cfg, world_size: int, vocab: Optional[int]) -> str:
    """The line a passed check ends with: the layout, the parameter count (the formula of
    config/shape.py, unpadded vocabulary) and the budget."""
    import dataclasses

    from megatron_boost.config.shape import ModelShape
    from megatron_boost.config.modes import TPMode
    from megatron_boost.config.validation import budget_line

    par, m = cfg.parallel, cfg.model
    model = dataclasses.replace(m, vocab_size=vocab) if vocab else m
    params = ModelShape.from_config(model).model_params(TPMode.parse(par.mode).is_lowrank)
    dp = world_size // (par.tp * par.pp)
    return (f"check passed: {world_size} processes = tp {par.tp} x pp {par.pp} x dp {dp} "
            f"(mode {par.mode}) | {params / 1e6:,.2f}M parameters ({m.num_layers} layers, "
            f"d={m.hidden_size}, vocabulary {vocab or m.vocab_size}) | "
            f"{budget_line(cfg).removeprefix('budget: ')}")


def select_device(requested: str) -> str:
    """'cuda' or 'cpu' (CPU mode, docs/design.md §9); before megatron's training modules are
    imported. ``auto`` falling back to the CPU says why in one line (rank 0), so a GPU job on
    a node with broken CUDA does not train on the CPU unnoticed."""
    from megatron_boost.runtime.cpu_mode import cuda_unusable_reason, maybe_use_cpu

    try:
        device = maybe_use_cpu(requested)
    except RuntimeError as err:  # e.g. device 'cuda' without a usable GPU
        raise ValueError(str(err)) from None
    if requested == "auto" and device == "cpu" and int(os.environ.get("RANK", "0")) == 0:
        print(f"note: training.device=auto falls back to the CPU: CUDA is unusable "
              f"({cuda_unusable_reason()}); set training.device=cuda to make this an error, "
              f"or training.device=cpu to silence this line", flush=True)
    return device


#: Set by the launcher (cli/launch.py): ranks hand their error line to it through torchrun's
#: per-rank error file (``TORCHELASTIC_ERROR_FILE``) rather than print it.
ERRORS_TO_LAUNCHER_ENV = "MBOOST_ERRORS_TO_LAUNCHER"


def _print_error(err: Exception) -> None:
    """One ``error:`` line from each rank that raised, a rank other than 0 with its rank. A
    configuration error or a divergence is the same on every rank, but whichever rank exits
    first makes torchrun end the others, possibly before rank 0 has printed: each rank's own
    line is what is sure to reach the log. Under the launcher the line goes to the rank's
    error file, which torchrun hands to the launcher with the rank's failure."""
    rank = int(os.environ.get("RANK", "0"))
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if os.environ.get(ERRORS_TO_LAUNCHER_ENV) and error_file:
        from megatron_boost.cli.errors import error_line

        line = error_line(err, rank=None if rank == 0 else rank)
        with open(error_file, "w") as f:  # torchrun's ProcessFailure reads message, timestamp
            json.dump({"message": line, "timestamp": int(time.time())}, f)
        return
    print_error(err, rank=None if rank == 0 else rank)


def _end_stalled_run(err: Exception) -> None:
    """A training step stalled on NCCL (train/resilience.py ``StallWatch``): report it as a
    raised RankTimeout would be, and end the process, whose main thread is blocked in a
    device read that nothing can interrupt."""
    _print_error(err)
    sys.stdout.flush()
    os._exit(FAULT_EXIT_CODE)


def main(argv: Optional[List[str]] = None, callbacks: Sequence = ()) -> int:
    """Entry point: parse, load and validate the config for this launch, train (with
    ``callbacks``, train/callbacks.py's ``TrainerCallback`` objects, called at its named points:
    a script of one's own may pass some)."""
    args = parse_args(argv)
    try:
        from megatron_boost.config.run import load_run_config

        world_size = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's
        cfg = load_run_config(args.config, args.overrides, world_size=world_size)
        if args.check:
            print(check_passed_line(cfg, world_size, check_launch(cfg)), flush=True)
            return 0
        if int(os.environ.get("RANK", "0")) == 0:
            from megatron_boost.config.validation import budget_line

            print(budget_line(cfg), flush=True)
        from megatron_boost.runtime.cpu_mode import cpu_mode_left_as_found

        with cpu_mode_left_as_found():  # main(argv) may be called in a process that goes on
            device = select_device(cfg.training.device)
            from megatron_boost.train.trainer import train

            return train(cfg, device, on_stall=_end_stalled_run, callbacks=callbacks)
    except (ValueError, TrainingDiverged, RankTimeout, CheckpointSaveFailed) as err:
        if os.environ.get("MBOOST_TRACEBACK"):
            raise
        _print_error(err)
        return CONFIG_ERROR_EXIT_CODE if isinstance(err, ValueError) else FAULT_EXIT_CODE
    except KeyboardInterrupt:  # Ctrl-C before the trainer caught it (start-up): nothing saved
        from megatron_boost.train.preemption import INTERRUPT_EXIT_CODE

        if int(os.environ.get("RANK", "0")) == 0 and not os.environ.get(ERRORS_TO_LAUNCHER_ENV):
            print("error: interrupted before training started; nothing was saved",
                  file=sys.stderr, flush=True)
        return INTERRUPT_EXIT_CODE
    finally:
        # Groups exist only if the training modules were imported (a --check never imports them,
        # nor megatron-core: it stays quick on a login node).
        if "megatron_boost.train.distributed" in sys.modules:
            sys.modules["megatron_boost.train.distributed"].shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
