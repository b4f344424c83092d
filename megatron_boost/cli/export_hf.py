"""Export a megatron-boost checkpoint (any mode and layout) as a Hugging Face model directory.

    python tools/export_hf.py runs/debug/checkpoints hf/debug [--fold] [--tokenizer MODEL]
"""

from __future__ import annotations

import argparse
from typing import List, Optional

from megatron_boost.cli.arg_types import shard_size
from megatron_boost.cli.errors import run_reporting_errors


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="export_hf.py", description=__doc__.splitlines()[1])
    p.add_argument("checkpoint", help="a run's checkpoint folder (latest iteration) or one "
                                      "iter_* folder")
    p.add_argument("output", help="new HF directory (must not exist)")
    p.add_argument("--fold", action="store_true",
                   help="σ = identity only: write W = B·A as plain LlamaForCausalLM")
    p.add_argument("--tokenizer", help="tokenizer file to export instead of the run config's")
    p.add_argument("--max-shard-size", type=shard_size, default="5GB",
                   help="safetensors shard limit (default 5GB)")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)

    def run():
        from megatron_boost.convert.export import export_checkpoint

        export_checkpoint(args.checkpoint, args.output, args.fold, args.tokenizer,
                          args.max_shard_size)
        print(f"exported {args.checkpoint} -> {args.output}")

    return run_reporting_errors(run)
