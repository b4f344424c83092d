"""The tools' error contract: a ``ValueError`` ends the tool with one line
``error: <message>`` on stderr and exit status 2 (``MBOOST_TRACEBACK=1`` shows the traceback),
as pretrain_lowrank.py does."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Callable

__all__ = ["run_reporting_errors", "USAGE_ERROR"]

USAGE_ERROR = 2


def run_reporting_errors(fn: Callable[[], None]) -> int:
    warnings.filterwarnings("ignore")  # megatron/torch notices on CPU would bury the result
    try:
        fn()
    except (ValueError, FileNotFoundError, OSError) as err:
        if os.environ.get("MBOOST_TRACEBACK"):
            raise
        msg = " ".join(str(err).split()) or type(err).__name__
        print(f"error: {msg}", file=sys.stderr, flush=True)
        return USAGE_ERROR
    return 0
