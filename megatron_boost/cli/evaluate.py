"""Perplexity of a megatron-boost checkpoint or an HF export on a text or JSONL file ("text"
field), in windows of the model's context length.

    python tools/evaluate.py runs/debug/checkpoints --input data/valid.txt
    torchrun --nproc_per_node=2 tools/evaluate.py runs/debug/checkpoints --input data/valid.txt \\
        parallel.tp=2
prints loss (mean nats per predicted token), perplexity exp(loss) and bits per byte.

``--threads`` sets torch's intra-op threads (default: the cores this process may use, shared by
the launch's processes on the node, but no more than the machine's idle cores: on a machine
busy with other work fewer threads, down to 1, are many times faster, as torch's threads wait
on each other). ``--batch-size`` sets the
windows per forward (default: an HF directory 8, a checkpoint its run's micro-batch size).

A checkpoint (saved in any layout) is evaluated in the launched layout: its saved run config
with TP = PP = 1 unless overridden (``parallel.tp=2 parallel.pp=2``; the other ranks are
data-parallel), fp32, the run's tokenizer and batch sizes. An HF directory is evaluated in one
process.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import List, Optional

from megatron_boost.cli.arg_types import output_file, positive_int
from megatron_boost.cli.errors import run_reporting_errors

#: The evaluation layout's defaults, before the command line's overrides: the saved run's own
#: layout need not fit this launch; only the tokenizer of the data section is read, so the
#: training data need not exist here (mock data skips their validation).
EVAL_DEFAULTS = ("parallel.tp=1", "parallel.pp=1", "parallel.vpp=null", "parallel.dp=null",
                 "parallel.use_distributed_optimizer=false", "training.recompute=null",
                 "training.precision=fp32", "data.mock=true")


#: Windows per forward of an HF model unless --batch-size says.
HF_BATCH_SIZE = 8


def default_threads() -> int:
    """The cores this process may run on (its CPU affinity, which a container or Slurm
    narrows), shared by the launch's processes on this node (torchrun's LOCAL_WORLD_SIZE), and
    no more than the machine's idle cores (its core count less the 1-minute load average):
    torch's threads spin-wait on each other, so on a busy machine extra threads cost far more
    than they give (docs: README, evaluate's throughput)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1
    mine = cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    idle = (os.cpu_count() or 1) - os.getloadavg()[0] if hasattr(os, "getloadavg") else mine
    return max(1, min(mine, int(idle)))


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="evaluate.py", description=__doc__.splitlines()[0])
    p.add_argument("model", help="checkpoint folder, iter_* folder or HF directory")
    p.add_argument("--input", required=True, help="text file, or .jsonl with a 'text' field")
    p.add_argument("--json", type=output_file,
                   help="also write the scores (loss, perplexity, bits_per_byte, tokens) to "
                        "this JSON file (checked before anything is loaded)")
    p.add_argument("--threads", type=positive_int, default=default_threads(),
                   help="torch's intra-op threads per process (default: the cores available to "
                        "this process over the processes of the launch on this node, at most "
                        "the machine's idle cores; here now %(default)s)")
    p.add_argument("--batch-size", type=positive_int,
                   help=f"windows per forward (default: an HF directory {HF_BATCH_SIZE}, a "
                        f"checkpoint its run's training.micro_batch_size)")
    p.add_argument("overrides", nargs="*",
                   help="section.key=value overrides of a checkpoint's run config, e.g. the "
                        "layout parallel.tp=2 parallel.pp=2 (default TP = PP = 1)")
    return p.parse_intermixed_args(argv)  # overrides may follow --input


def read_text(path: str) -> str:
    """The text to score: the file, or the ``text`` fields of a .jsonl file's records. A bad
    record is reported with its file and line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--input '{path}' does not exist")
    try:
        raw = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--input '{path}' is not UTF-8 text ({err})") from None
    if not raw.strip():
        raise ValueError(f"--input '{path}' holds no text to score (it is empty); give a text "
                         f"file, or a .jsonl file of {{\"text\": ...}} records")
    if p.suffix != ".jsonl":
        return raw
    texts = []
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({err})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{path}:{lineno}: a .jsonl record must be an object with a "
                             f"string 'text' field; give one per line")
        texts.append(record["text"])
    if not "".join(texts).strip():
        raise ValueError(f"--input '{path}' holds no text to score (its records' 'text' "
                         f"fields are empty)")
    return "\n".join(texts)


def scored_windows(ids: List[int], seq_length: int, path: str) -> List[List[int]]:
    """The windows of ``ids`` (``text_windows``); a ValueError when they predict nothing (a
    text of fewer than two tokens) rather than a division by zero tokens."""
    from megatron_boost.convert.text_eval import text_windows

    if len(ids) < 2:
        raise ValueError(f"--input '{path}' is {len(ids)} token(s) long; a score needs at "
                         f"least 2 (each token is predicted from the ones before it)")
    return text_windows(ids, seq_length)


def _report(name: str, text: str, windows: list, total: float, seconds: float,
            seq_length: int) -> dict:
    """The scores of a summed loss, printed as one line (by rank 0)."""
    from megatron_boost.convert.scoring import bits_per_byte, perplexity
    from megatron_boost.convert.text_eval import predicted_tokens
    from megatron_boost.train.distributed import print0

    predicted = predicted_tokens(windows)
    result = {"loss": total / predicted, "perplexity": perplexity(total, predicted),
              "bits_per_byte": bits_per_byte(total, len(text.encode("utf-8"))),
              "tokens": predicted}
    print0(f"[{name}] {predicted} predicted tokens in {len(windows)} windows of {seq_length} "
           f"({predicted / seconds:,.0f} tokens/s): loss {result['loss']:.4f} | perplexity "
           f"{result['perplexity']:.3f} | bits per byte {result['bits_per_byte']:.4f}")
    return result


def _evaluate_hf(path: str, text: str, overrides: List[str], source: str,
                 batch_size: int) -> dict:
    from tqdm import tqdm

    from megatron_boost.convert.sources import open_model
    from megatron_boost.convert.text_eval import hf_summed_loss, same_length_batches

    if overrides or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(f"'{path}' is an HF directory: it is evaluated in one process without "
                         f"overrides (python tools/evaluate.py {path} --input FILE)")
    with open_model(path) as m:
        windows = scored_windows(m.tokenizer.encode(text), m.seq_length, source)
        batches = same_length_batches(windows, batch_size)
        start = time.perf_counter()
        # disable=None: no bar where stderr is not a terminal (a log file)
        total = hf_summed_loss(m.logits, tqdm(batches, desc="evaluate", unit="batch",
                                              disable=None))
        return _report(m.name, text, windows, total, time.perf_counter() - start,
                       m.seq_length)


def _batch_overrides(batch_size: Optional[int], cfg, world_size: int) -> List[str]:
    """``--batch-size`` as the run config's batch sizes: one micro-batch of that many windows
    per data-parallel rank and global batch (none: the run's own)."""
    if batch_size is None:
        return []
    dp = world_size // (cfg.parallel.tp * cfg.parallel.pp)
    return [f"training.micro_batch_size={batch_size}",
            f"training.global_batch_size={batch_size * dp}"]


def _evaluate_checkpoint(path: str, text: str, overrides: List[str], source: str,
                         batch_size: Optional[int]) -> dict:
    import torch.distributed as dist
    from tqdm import tqdm

    from megatron_boost.cli.pretrain import select_device
    from megatron_boost.convert import megatron_side as mb
    from megatron_boost.config.validation import validate_reading_launch
    from megatron_boost.convert.text_eval import layout_summed_loss
    from megatron_boost.runtime.cpu_mode import cpu_mode_left_as_found

    ckpt = mb.resolve_checkpoint(path)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    cfg, _ = mb.saved_run_config(ckpt, [*EVAL_DEFAULTS, *overrides])
    if batch_size is not None:
        cfg, _ = mb.saved_run_config(ckpt, [*EVAL_DEFAULTS, *overrides, *_batch_overrides(
            batch_size, cfg, world_size)])
    # evaluation writes nothing in the run's directories (they may be read-only here)
    validate_reading_launch(cfg, world_size)
    if not cfg.data.tokenizer_model:
        raise ValueError(f"{ckpt} was trained without a tokenizer (mock data); text needs one")
    seq, par = cfg.model.seq_length, cfg.parallel
    windows = scored_windows(list(mb.build_tokenizer(cfg.data).tokenize(text)), seq, source)
    # The saved device is the training machine's: a GPU run's checkpoint evaluates anywhere
    # ('auto' says in one line why it falls back to the CPU), unless the command line says.
    saved_device = cfg.training.device
    requested = "auto" if saved_device == "cuda" and not any(
        o.startswith("training.device=") for o in overrides) else saved_device
    with cpu_mode_left_as_found(), \
            mb.launched_world(cfg, select_device(requested)) as device:
        chunks = mb.launched_model(cfg, ckpt, device)
        start = time.perf_counter()
        total = layout_summed_loss(chunks, windows, cfg, device, progress=lambda batches: tqdm(
            batches, desc="evaluate", unit="batch", disable=None if dist.get_rank() == 0
            else True))  # None: no bar where stderr is not a terminal (a log file)
        name = (f"megatron {par.mode} tp={par.tp} pp={par.pp} "
                f"dp={world_size // (par.tp * par.pp)}")
        return _report(name, text, windows, total, time.perf_counter() - start, seq)


def evaluate(args) -> dict:
    import torch

    text = read_text(args.input)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # for this evaluation; a caller's setting comes back
    try:
        if (Path(args.model) / "config.json").is_file():
            result = _evaluate_hf(args.model, text, args.overrides, args.input,
                                  args.batch_size or HF_BATCH_SIZE)
        else:
            result = _evaluate_checkpoint(args.model, text, args.overrides, args.input,
                                          args.batch_size)
    finally:
        torch.set_num_threads(previous_threads)
    if args.json and int(os.environ.get("RANK", "0")) == 0:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    return run_reporting_errors(lambda: evaluate(args))
