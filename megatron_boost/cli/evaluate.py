"""Perplexity of a megatron-boost checkpoint (any layout, resharded into one process) or an HF
export on a text or JSONL file ("text" field), in windows of the model's context length.

    python tools/evaluate.py runs/debug/checkpoints --input data/valid.txt
prints loss (mean nats per predicted token), perplexity exp(loss) and bits per byte.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import List, Optional

from megatron_boost.convert.errors import run_reporting_errors


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="evaluate.py", description=__doc__.splitlines()[1])
    p.add_argument("model", help="checkpoint folder, iter_* folder or HF directory")
    p.add_argument("--input", required=True, help="text file, or .jsonl with a 'text' field")
    return p.parse_args(argv)


def read_text(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--input '{path}' does not exist")
    if p.suffix == ".jsonl":
        return "\n".join(json.loads(line)["text"] for line in p.read_text().splitlines()
                         if line.strip())
    return p.read_text()


def evaluate(args) -> dict:
    import torch
    from tqdm import tqdm

    from megatron_boost.convert.scoring import bits_per_byte, perplexity, summed_loss
    from megatron_boost.convert.sources import open_model

    text = read_text(args.input)
    with open_model(args.model) as m:
        ids = m.tokenizer.encode(text)
        windows = [ids[i:i + m.seq_length] for i in range(0, len(ids), m.seq_length)]
        windows = [w for w in windows if len(w) > 1]
        total, predicted, start = 0.0, 0, time.perf_counter()
        for w in tqdm(windows, desc="evaluate", unit="window"):
            t = torch.tensor([w])
            total += summed_loss(m.logits(t)[0], t[0])
            predicted += len(w) - 1
        rate = predicted / (time.perf_counter() - start)
        result = {"loss": total / predicted, "perplexity": perplexity(total, predicted),
                  "bits_per_byte": bits_per_byte(total, len(text.encode("utf-8"))),
                  "tokens": predicted}
        print(f"[{m.name}] {predicted} predicted tokens in {len(windows)} windows of "
              f"{m.seq_length} ({rate:,.0f} tokens/s): loss {result['loss']:.4f} | "
              f"perplexity {result['perplexity']:.3f} | bits per byte "
              f"{result['bits_per_byte']:.4f}", flush=True)
    return result


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    return run_reporting_errors(lambda: evaluate(args))
