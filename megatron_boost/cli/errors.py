"""One ``error: <message>`` line instead of a traceback, for every command-line entry point."""

from __future__ import annotations

import functools
import os
import sys
import warnings
from typing import Callable, Optional, Sequence

__all__ = ["USAGE_ERROR_EXIT_CODE", "error_line", "print_error", "one_line_errors",
           "run_reporting_errors"]

#: Exit status for usage / configuration / input errors (argparse uses the same).
USAGE_ERROR_EXIT_CODE = 2


def error_line(err: BaseException, rank: Optional[int] = None) -> str:
    """``error: <message>``, the message on one line; ``error: rank N: <message>`` when a rank
    of a multi-process launch reports its own error."""
    msg = " ".join(str(err).split()) or type(err).__name__
    where = "" if rank is None else f"rank {rank}: "
    return f"error: {where}{msg}"


def print_error(err: BaseException, rank: Optional[int] = None) -> None:
    """:func:`error_line` on stderr."""
    print(error_line(err, rank), file=sys.stderr, flush=True)


def one_line_errors(main: Callable[[Optional[Sequence[str]]], int]):
    """Wrap a tool's ``main(argv)``: a ``ValueError`` (bad configuration or input) is reported
    by :func:`print_error` with exit status 2; ``MBOOST_TRACEBACK=1`` re-raises it instead."""

    @functools.wraps(main)
    def wrapped(argv: Optional[Sequence[str]] = None) -> int:
        try:
            return main(argv)
        except ValueError as err:
            if os.environ.get("MBOOST_TRACEBACK"):
                raise
            print_error(err)
            return USAGE_ERROR_EXIT_CODE
    return wrapped


def run_reporting_errors(fn: Callable[[], None]) -> int:
    """Run a conversion tool's body: a ``ValueError`` or file error (bad input) is reported by
    :func:`print_error` with exit status 2 (``MBOOST_TRACEBACK=1`` re-raises it); 0 otherwise.
    megatron's and torch's CPU notices are silenced so they do not bury the result."""
    warnings.filterwarnings("ignore")
    try:
        fn()
    except (ValueError, OSError) as err:  # FileNotFoundError is an OSError
        if os.environ.get("MBOOST_TRACEBACK"):
            raise
        print_error(err)
        return USAGE_ERROR_EXIT_CODE
    return 0
