"""Import a local Hugging Face LLaMA-architecture model as a megatron-boost checkpoint.

    python tools/import_hf.py HF_DIR OUTPUT_DIR [--config configs/cola-60m.yaml] [overrides]

Full rank (parallel.mode=full) keeps the weights; naive/boost initialise every projection by
truncated SVD to the configured ranks (model.attn_rank, model.mlp_rank). The model's shape and
(by default) its tokenizer come from HF_DIR; the config gives the mode, ranks, σ, layout and
training settings (default: the built-in defaults). Writes OUTPUT_DIR/train.yaml (the imported
shape, checkpoint.init_from=OUTPUT_DIR, logging.run_dir=OUTPUT_DIR-run beside it or --run-dir)
and prints the command that trains from it, to run from the directory the import ran in
(the paths in train.yaml are as given here).
"""

from __future__ import annotations

import argparse
from typing import List, Optional

from megatron_boost.cli.errors import run_reporting_errors


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="import_hf.py", description=__doc__.splitlines()[1])
    p.add_argument("hf_dir", help="local HF model directory (safetensors or .bin)")
    p.add_argument("output", help="new checkpoint directory (must not exist)")
    p.add_argument("--config", help="YAML run configuration (mode, ranks, layout, training "
                                     "settings; its model shape is replaced by HF_DIR's)")
    p.add_argument("--sample-text", help="text file for the perplexity check")
    p.add_argument("--run-dir", help="logging.run_dir of the training run written into "
                                     "train.yaml (default: OUTPUT_DIR-run, beside OUTPUT_DIR)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return p.parse_intermixed_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)

    def run():
        from pathlib import Path

        from megatron_boost.convert.importer import import_hf

        text = Path(args.sample_text).read_text() if args.sample_text else None
        result = import_hf(args.hf_dir, args.output, args.config, args.overrides, text,
                           args.run_dir)
        print(f"imported {args.hf_dir} -> {result['checkpoint']}; its run configuration "
              f"(shape, tokenizer, checkpoint.init_from): {result['config']}")
        print(f"train from it (run directory {result['run_dir']}; a relaunch resumes from "
              f"the run's own checkpoints):\n  {result['command']}")
        if "PREFIX" in result["command"]:
            print(f"PREFIX: your corpus tokenized with this model's tokenizer: python "
                  f"tools/preprocess_data.py --input FILES --tokenizer-model {args.hf_dir} "
                  f"--output-prefix PREFIX --append-eod")

    return run_reporting_errors(run)
