"""Sample text from a megatron-boost checkpoint (any layout) or an HF export.

    python tools/generate.py runs/debug/checkpoints --prompt "To be" [--max-new-tokens 40]
        [--temperature 0 (greedy) | 0.8 --top-p 0.9 --seed 1]

Prints ``[<model>] <prompt><continuation>``: the prompt as given, then exactly the text the new
tokens add (the whole sequence is decoded, so a continuation's leading space is kept).
"""

from __future__ import annotations

import argparse
from typing import List, Optional

from megatron_boost.cli.arg_types import (non_negative_float, non_negative_int, positive_int,
                                           probability)
from megatron_boost.cli.errors import run_reporting_errors


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="generate.py", description=__doc__.splitlines()[1])
    p.add_argument("model", help="checkpoint folder, iter_* folder or HF directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=positive_int, default=40)
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=probability, default=1.0)
    p.add_argument("--seed", type=non_negative_int, default=0)
    return p.parse_args(argv)


def generate(args) -> List[int]:
    import torch

    from megatron_boost.convert.generation import continuation_text, sample
    from megatron_boost.convert.sources import open_model

    with open_model(args.model) as m:
        prompt = m.tokenizer.encode(args.prompt)
        if len(prompt) + args.max_new_tokens > m.seq_length:
            raise ValueError(f"prompt ({len(prompt)} tokens) + --max-new-tokens "
                             f"({args.max_new_tokens}) exceed the context of {m.seq_length}")
        new = sample(lambda ids: m.logits(torch.tensor([ids]))[0, -1], prompt,
                     args.max_new_tokens, args.temperature, args.top_p, args.seed,
                     m.tokenizer.eos_token_id)
        text = continuation_text(m.tokenizer.decode, prompt, new)
        print(f"[{m.name}] {args.prompt}{text}", flush=True)
    return new


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    return run_reporting_errors(lambda: generate(args))
