"""argparse ``type=`` checks for the tools' numeric arguments, mode lists and sizes: a value out
of range is refused while the command line is parsed, before anything is loaded, with
argparse's one ``error:`` line (exit status 2) naming the argument, the value and the rule."""

from __future__ import annotations

import argparse
import os
import re
import tempfile

__all__ = ["positive_int", "non_negative_int", "non_negative_float", "probability",
           "fraction", "mode_list", "layer_mode_list", "bench_mode_list", "shard_size",
           "output_file"]


def _number(text: str, kind):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not {'an integer' if kind is int else 'a number'}") from None


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer (>= 1)")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def probability(text: str) -> float:
    """A probability mass to keep, in (0, 1] (top-p)."""
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} must be in (0, 1]")
    return value


def fraction(text: str) -> float:
    """A fraction in [0, 1]."""
    value = _number(text, float)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 1]")
    return value


def _listed_modes(text: str, known: list) -> list:
    """``text`` split at commas: at least one name, each in ``known`` and given once."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in known]
    if unknown or not modes:
        what = f"'{unknown[0]}' is not a mode" if unknown else "no mode given"
        raise argparse.ArgumentTypeError(f"{what}: give a comma-separated list of "
                                         f"{', '.join(known)}")
    if len(set(modes)) < len(modes):
        raise argparse.ArgumentTypeError(f"'{text}' names a mode twice")
    return modes


def tp_mode(text: str):
    """One tensor-parallel mode (``full``, ``naive`` or ``boost``): its :class:`TPMode` member."""
    from megatron_boost.config.modes import TPMode

    names = [m.value for m in TPMode]
    if text not in names:
        raise argparse.ArgumentTypeError(f"'{text}' is not a mode: give one of "
                                         f"{', '.join(names)}")
    return TPMode(text)


def mode_list(text: str) -> list:
    """A comma-separated list of tensor-parallel modes (``full,naive,boost``): at least one,
    each known and given once (an unknown mode would be skipped and the tool exit 0 having
    measured nothing); the :class:`TPMode` members, in the order given."""
    from megatron_boost.config.modes import TPMode

    return [TPMode.parse(m) for m in _listed_modes(text, [m.value for m in TPMode])]


def layer_mode_list(text: str) -> list:
    """``mode_list``'s names plus ``full+sp``: full rank as the BOOST paper measured it
    (``full``: all-reduce TP, no sequence parallelism) and as megatron users run it
    (``full+sp``); the labels (cli/mode_labels.py reads them)."""
    from megatron_boost.cli.mode_labels import FULL_SP, label_of
    from megatron_boost.config.modes import TPMode

    return _listed_modes(text, [label_of(m) for m in TPMode] + [FULL_SP])


def bench_mode_list(text: str) -> list:
    """``layer_mode_list`` plus ``full+swiglu``: the benchmark's layouts (the paper's full rank
    with megatron's fused SwiGLU, which the CPU runs only when asked)."""
    from megatron_boost.cli.mode_labels import FULL_SP, FULL_SWIGLU, label_of
    from megatron_boost.config.modes import TPMode

    return _listed_modes(text, [label_of(m) for m in TPMode] + [FULL_SP, FULL_SWIGLU])


def shard_size(text: str) -> str:
    """A positive size with huggingface_hub's units (``5GB``, ``500MB``: TB, GB, MB, KB), as
    its shard splitter reads it; a negative one (which it would accept) is refused."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(TB|GB|MB|KB)", text.strip(), re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive size such as 5GB or "
                                         f"500MB (units TB, GB, MB, KB)")
    return f"{match.group(1)}{match.group(2).upper()}"


def output_file(text: str) -> str:
    """A file the tool may write when its work is done (``--json``, ``--out``), checked before
    the work: its folder exists and a file can be created there (probed by creating and
    removing one: permission bits say nothing for root, a read-only file system refuses the
    creation itself), and the path is not a folder."""
    path = os.path.abspath(text)
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"'{text}' is a directory; give a file name")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"'{text}' cannot be written: its folder {folder} "
                                         f"does not exist (or is not a directory); create it "
                                         f"or choose another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".mboost-probe-", dir=folder)
    except OSError as err:
        raise argparse.ArgumentTypeError(f"'{text}' cannot be written: cannot create a file in "
                                         f"{folder} ({err.strerror}); choose another "
                                         f"path") from None
    os.close(fd)
    os.unlink(probe)
    return text
