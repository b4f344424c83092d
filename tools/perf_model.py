#!/usr/bin/env python
"""Cluster performance model CLI: iteration time, per-GPU memory and communication of
full / naive / boost training. The model lives in megatron_boost/perf/model.py.

Examples:
    python tools/perf_model.py --compare-published
    python tools/perf_model.py --config configs/cola-7b.yaml --gpus 8 --gpu a100-80gb --tp 4
    python tools/perf_model.py --config configs/cola-7b.yaml --gpus 64 --gpu h100-80gb --recommend
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_boost.perf.model import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
