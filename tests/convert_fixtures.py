"""Helpers shared by the conversion, evaluation and lm-eval tests (the session fixtures that use
them are in conftest.py): the sample text and its tokenizer, trainer and torchrun launches, and
a random tiny LLaMA."""

import os
import subprocess
import sys
from pathlib import Path
from typing import List

import torch

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
#: Seconds a tokenizer training or a torchrun launch of these tests may take (a few on an idle
#: 2-core machine; the bound only turns a hang into a failure).
TIMEOUT = 600

#: Trainer checkpoints of every kind of layout: name -> (processes, overrides).
LAYOUTS = {
    "boost_tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    # tied embeddings: the last stage's copy saved under the embedding's key, resharded to TP 1
    "boost_tp2_pp2_tied": (4, ["parallel.tp=2", "parallel.pp=2",
                               "model.share_embeddings_and_output_weights=true"]),
    "naive_tp2": (2, ["parallel.mode=naive", "parallel.tp=2"]),
    "full_tp2": (2, ["parallel.mode=full", "parallel.tp=2"]),
    "boost_distopt_identity": (2, ["parallel.use_distributed_optimizer=true",
                                   "model.bottleneck_activation=identity"]),
}

#: One iteration at lr = min_lr = 0: the checkpoint holds the trainer's layout-independent
#: initial weights (docs/design.md §8) and every save and load path runs.
FROZEN_TRAINING = ["training.train_iters=1", "optimizer.warmup_iters=0", "optimizer.lr=0",
                   "optimizer.min_lr=0", "training.eval_iters=0", "data.mock=true",
                   "logging.tensorboard=false"]


def sample_text() -> str:
    """ASCII text for the tokenizer (byte fallback covers the rest)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return "".join(c for c in text if c == "\n" or 32 <= ord(c) < 127)


def train_tokenizer(d: Path, vocab_size: int = 400) -> str:
    (d / "text.txt").write_text(sample_text())
    subprocess.run([sys.executable, str(ROOT / "tools/train_tokenizer.py"), "--input",
                    str(d / "text.txt"), "--vocab-size", str(vocab_size), "--model-prefix",
                    str(d / "tok"), "--num-threads", "1"], check=True, capture_output=True,
                   timeout=TIMEOUT)
    return str(d / "tok.model")


def torchrun(nproc: int, script: str, args: List[str]) -> str:
    """Launch ``script`` on ``nproc`` processes; returns stdout (the test fails with the tail
    of both streams unless every rank exits 0)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([TORCHRUN, f"--nproc_per_node={nproc}", str(ROOT / script), *args],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def train(nproc: int, overrides: List[str], run_dir: Path) -> str:
    """A trainer run of configs/debug.yaml with ``overrides`` on ``nproc`` ranks of the rank
    pool (tests/rank_pool.py, through tests/test_training.py's ``run_training``); returns its
    stdout (the test fails with the tail of both streams unless every rank exits 0)."""
    from tests.test_training import run_training

    return run_training(nproc, [*overrides, f"logging.run_dir={run_dir}"],
                        timeout=TIMEOUT).stdout


def random_llama(d: Path, num_key_value_heads: int = 2, vocab_size: int = 256,
                 tie_word_embeddings: bool = False) -> Path:
    """A randomly initialised LlamaForCausalLM of the debug size (GQA), saved locally."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=num_key_value_heads, max_position_embeddings=32,
                         rms_norm_eps=1e-5,
                         tie_word_embeddings=tie_word_embeddings)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # non-trivial norms, so a norm mapped to the wrong slot shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(d)
    return d
