"""Every bad input to an entry point ends in one clear line and changes nothing.

A table of cases, each a command line of an entry point (``pretrain_lowrank.py`` as one process
or under torchrun, and the tools). Most cases call the entry point's ``main(argv)`` in this
process (stdout and stderr captured, ``SystemExit`` taken as the exit status): what they check is
the message and the status, and a fresh interpreter per case only adds its start-up. About a
dozen (``process=True``) run as real subprocesses, where being a process is what is tested:
torchrun launches, the launcher's ``--check``, a plain ``python pretrain_lowrank.py``, a damaged
checkpoint, ``scripts/setup_env.sh`` (its request, checked before anything is created) and a few
tools. Every case must:

* exit non-zero (2 where the input is a usage or configuration error),
* print exactly one line starting ``error:`` (argparse's ``<prog>: error:`` counts) on stdout or
  stderr, containing every needle of the case (the value and the rule it breaks) and none of
  its ``forbid`` strings (under torchrun, the other ranks repeat the same message as
  ``error: rank N: ...``, and rank 0's own line may be missing when torchrun ended it after
  another rank exited: cli/pretrain.py),
* print no Python traceback (the torchrun launcher's own ``ChildFailedError`` report is not the
  program's and is cut before checking),
* write nothing: the run directory is not created and any checkpoint it was given is unchanged
  (same files, sizes and CRC-32s); an in-process case also leaves no CPU mode or process group
behind (tests/conftest.py checks every test for that).

The process runs as root here, so file permissions cannot make a path unwritable; the
"not writable" cases use a path below a regular file and a path under ``/proc`` (where root
cannot create directories either).

The cases that load a checkpoint share one small trained checkpoint (configs/debug.yaml, three
iterations, trained once in this process), copied and damaged per case. The subprocess cases run concurrently,
a few at a time, beside the in-process ones.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Tuple

import pytest

from tests.test_training import DEBUG, ENTRY, ROOT, _env, _sentencepiece_model

TIMEOUT = 240
PARALLEL_CASES = 3
ERROR_LINE = re.compile(r"^(\S+: )?error: ")
RANKED_ERROR_LINE = re.compile(r"^error: rank \d+: ")


def error_messages(lines) -> set:
    """The distinct messages of ``error:`` lines, a rank's own prefix (``rank N: ``) removed:
    under torchrun every rank that raised prints the same message."""
    return {RANKED_ERROR_LINE.sub("error: ", line) for line in lines if ERROR_LINE.match(line)}


@dataclass
class Ctx:
    """Paths a case may use: its own directory, the shared inputs and the shared checkpoint."""

    case: Path
    shared: Path

    @property
    def run(self) -> Path:
        return self.case / "run"

    @property
    def ckpt(self) -> Path:
        return self.case / "ckpt"

    @property
    def tok(self) -> str:
        return str(self.shared / "spm.model")


@dataclass(frozen=True)
class Case:
    name: str
    argv: Callable[[Ctx], list]
    needles: Tuple[str, ...]
    code: Optional[int] = 2  # None: any non-zero status
    forbid: Tuple[str, ...] = ()
    setup: Optional[Callable[[Ctx], None]] = None
    uses_checkpoint: bool = False
    process: bool = False  # a real subprocess (torchrun always is); else main(argv) in-process
    needs: Tuple[str, ...] = ()  # modules the case needs (skipped with the reason without them)


# ---------------------------------------------------------------------------------------------
# command builders
# ---------------------------------------------------------------------------------------------


def train(*overrides, config: Optional[str] = None):
    """``python pretrain_lowrank.py --config <config> <overrides>`` with run_dir in the case."""
    def argv(ctx: Ctx):
        cfg = (config or DEBUG).format(case=ctx.case)
        items = [o.format(case=ctx.case, tok=ctx.tok, shared=ctx.shared) for o in overrides]
        if not any(o.startswith("logging.run_dir=") for o in items):
            items.append(f"logging.run_dir={ctx.run}")
        return [sys.executable, ENTRY, "--config", cfg, *items]
    return argv


def torchrun2(*overrides):
    def argv(ctx: Ctx):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2"] + train(*overrides)(ctx)[1:]
    return argv


def check(world_size: int, *overrides):
    """The launchers' validation: ``pretrain_lowrank.py --check --world-size N ...``."""
    def argv(ctx: Ctx):
        cmd = train(*overrides)(ctx)
        return [*cmd[:2], "--check", "--world-size", str(world_size), *cmd[2:]]
    return argv


def resume(*overrides):
    """Train from the case's copy of the shared checkpoint."""
    return train("checkpoint.load={case}/ckpt", "training.train_iters=5", *overrides)


def tool(script: str, *args):
    def argv(ctx: Ctx):
        return [sys.executable, str(ROOT / "tools" / script),
                *(a.format(case=ctx.case, tok=ctx.tok, shared=ctx.shared) for a in args)]
    return argv


def setup_env(**env):
    """``scripts/setup_env.sh --cpu`` with ``env`` and its environment at the case's run
    directory (which must not appear: the request is checked before anything is created)."""
    def argv(ctx: Ctx):
        return ["env", f"VENV={ctx.run}", f"PYTHON={sys.executable}",
                *(f"{k}={v}" for k, v in env.items()), "bash", "scripts/setup_env.sh", "--cpu"]
    return argv


def write(name: str, content):
    def setup(ctx: Ctx):
        path = ctx.case / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return setup


def setups(*steps):
    """Several setup steps, in order."""
    def setup(ctx: Ctx):
        for step in steps:
            step(ctx)
    return setup


def hf_tokenizer_dir(name: str, *files: str):
    """A directory ``<case>/<name>`` holding only ``files`` (each ``{}``)."""
    def setup(ctx: Ctx):
        (ctx.case / name).mkdir()
        for f in files:
            (ctx.case / name / f).write_text("{}")
    return setup


def _data_prefix(ctx: Ctx, name: str) -> Path:
    return ctx.case / name


def dataset(name: str, damage: Optional[Callable[[Path], None]] = None, max_id: int = 299):
    """A small valid indexed dataset ``<case>/<name>.bin/.idx`` (ids < max_id + 1), then
    ``damage(prefix)``."""
    def setup(ctx: Ctx):
        _write_dataset(_data_prefix(ctx, name), max_id)
        if damage is not None:
            damage(_data_prefix(ctx, name))
    return setup


def _write_dataset(prefix: Path, max_id: int) -> None:
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(20):
        doc = rng.integers(4, 200, size=60)
        doc[-1] = max_id  # the largest id appears in every document
        builder.add_document(torch.from_numpy(doc.astype(np.int64)), [60])
    builder.finalize(str(prefix) + ".idx")


def _patch_bytes(suffix: str, offset: int, data: bytes):
    def damage(prefix: Path):
        path = Path(str(prefix) + suffix)
        raw = bytearray(path.read_bytes())
        raw[offset:offset + len(data)] = data
        path.write_bytes(bytes(raw))
    return damage


def _truncate(suffix: str, keep: int):
    def damage(prefix: Path):
        path = Path(str(prefix) + suffix)
        path.write_bytes(path.read_bytes()[:keep])
    return damage


def checkpoint(damage: Optional[Callable[[Path], None]] = None):
    """Copy the shared checkpoint into ``<case>/ckpt``, then ``damage(<case>/ckpt)``."""
    def setup(ctx: Ctx):
        shutil.copytree(ctx.shared / "trained" / "checkpoints", ctx.ckpt)
        if damage is not None:
            damage(ctx.ckpt)
    return setup


def _first_shard(ckpt: Path) -> Path:
    return sorted(ckpt.glob("iter_*/*.distcp"))[0]


def _truncate_shard(ckpt: Path) -> None:
    shard = _first_shard(ckpt)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _flip_shard_bytes(ckpt: Path) -> None:
    shard = _first_shard(ckpt)
    raw = bytearray(shard.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 8] = bytes(b ^ 0xFF for b in raw[middle:middle + 8])
    shard.write_bytes(bytes(raw))


def _tracker(text: str):
    def damage(ckpt: Path):
        (ckpt / "latest_checkpointed_iteration.txt").write_text(text)
    return damage


def _remove(name: str):
    def damage(ckpt: Path):
        next(ckpt.glob(f"iter_*/{name}")).unlink()
    return damage


def _half_written(ckpt: Path) -> None:
    """The newest iteration as a save leaves it mid-write: still ``iter_N.tmp``, no manifest."""
    done = sorted(ckpt.glob("iter_*"))[-1]
    (done / "manifest.json").unlink()
    done.rename(done.with_name(done.name + ".tmp"))


def hf_dir(damage: Optional[Callable[[Path], None]] = None):
    """Copy the shared random HF LLaMA into ``<case>/hf``, then ``damage(<case>/hf)``."""
    def setup(ctx: Ctx):
        shutil.copytree(ctx.shared / "hf", ctx.case / "hf")
        if damage is not None:
            damage(ctx.case / "hf")
    return setup


def _truncate_safetensors(hf: Path) -> None:
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _break_config_json(hf: Path) -> None:
    # line 4 lacks the comma after line 3
    (hf / "config.json").write_text('{\n  "model_type": "llama",\n  "hidden_size": 64\n'
                                    '  "x": 1\n}')


HF = ("transformers", "safetensors")

DATA = ("data.mock=false", "data.tokenizer_model={tok}", "data.split='1,0,0'")

# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------

CASES = [
    # -- the YAML file ---------------------------------------------------------------------
    Case("yaml_missing", train(config="{case}/nope.yaml"), ("nope.yaml", "does not exist"),
         process=True),
    Case("yaml_is_directory", train(config="{case}"), ("is a directory",)),
    Case("yaml_empty", train(config="{case}/c.yaml"), ("c.yaml", "is empty"),
         setup=write("c.yaml", "")),
    Case("yaml_not_mapping", train(config="{case}/c.yaml"), ("c.yaml", "mapping of sections",
                                                              "list"),
         setup=write("c.yaml", "- model\n- parallel\n")),
    Case("yaml_broken_syntax", train(config="{case}/c.yaml"), ("c.yaml:3", "not valid YAML"),
         setup=write("c.yaml", "model:\n  hidden_size: [64\nparallel: {tp: 1}\n")),
    Case("yaml_not_text", train(config="{case}/c.yaml"), ("c.yaml", "not UTF-8"),
         setup=write("c.yaml", b"model:\n  hidden_size: \xff\xfe\n")),
    Case("yaml_section_not_mapping", train(config="{case}/c.yaml"), ("'model'", "mapping"),
         setup=write("c.yaml", "model: 5\n")),
    # -- keys and types --------------------------------------------------------------------
    Case("unknown_section", train("bogus.key=1"), ("unknown section 'bogus'",)),
    Case("unknown_key", train("model.bogus_key=3"), ("unknown key 'bogus_key'", "model")),
    Case("override_typo_names_the_override", train("training.train_iter=10"),
         ("unknown key 'train_iter'", "the override 'training.train_iter=10'",
          "did you mean 'train_iters'?"), forbid=("debug.yaml",)),
    Case("yaml_typo_names_file_and_line", train(config="{case}/c.yaml"),
         ("c.yaml:3", "unknown key 'hiden_size'", "did you mean 'hidden_size'?"),
         setup=write("c.yaml", "model:\n  num_layers: 2\n  hiden_size: 64\n")),
    Case("override_without_value", train("parallel.tp"), ("parallel.tp", "section.key=value")),
    Case("wrong_type_str_for_int", train("model.hidden_size=wide"),
         ("model.hidden_size", "'wide'", "int")),
    Case("wrong_type_bool_for_int", train("parallel.tp=true"), ("parallel.tp", "True",
                                                                 "integer")),
    Case("wrong_type_number_for_str", train("parallel.mode=3"), ("parallel.mode", "3")),
    Case("unknown_mode", train("parallel.mode=fast"), ("fast", "full", "naive", "boost")),
    Case("unknown_precision", train("training.precision=fp16"), ("training.precision",
                                                                 "fp16")),
    # -- positivity: each value names its own rule -----------------------------------------
    Case("hidden_size_negative", train("model.hidden_size=-64"),
         ("model.hidden_size", "-64", "positive"), forbid=("attn_rank",)),
    Case("lr_negative", train("optimizer.lr=-1"), ("optimizer.lr", "-1", ">= 0"),
         forbid=("min_lr",)),
    # a negative value that would quietly disable a feature (clipping, evaluation) is refused
    Case("clip_grad_negative", train("optimizer.clip_grad=-1"),
         ("optimizer.clip_grad", "-1", ">= 0")),
    Case("eval_iters_negative", train("training.eval_iters=-1"),
         ("training.eval_iters", "-1", ">= 0")),
    Case("peak_tflops_negative", train("logging.peak_tflops=-3"),
         ("logging.peak_tflops", "-3", "positive")),
    Case("adam_beta_out_of_range", train("optimizer.adam_beta2=1"),
         ("optimizer.adam_beta2", "1", "[0, 1)")),
    Case("dropout_out_of_range", train("model.hidden_dropout=1.0"),
         ("model.hidden_dropout", "1.0", "[0, 1)", "0.0 for no dropout")),
    Case("boost_hidden_dropout_at_tp2", check(2, "parallel.tp=2", "model.hidden_dropout=0.1"),
         ("model.hidden_dropout", "0.1", "parallel.tp=1", "boost", "same positions")),
    Case("num_layers_zero", train("model.num_layers=0"), ("model.num_layers", "0",
                                                          "positive")),
    Case("seq_length_zero", train("model.seq_length=0"), ("model.seq_length", "0",
                                                          "positive")),
    Case("micro_batch_zero", train("training.micro_batch_size=0"),
         ("training.micro_batch_size", "0", "positive")),
    Case("train_iters_zero", train("training.train_iters=0"), ("training.train_iters", "0")),
    Case("tp_zero", train("parallel.tp=0"), ("parallel.tp", "0", "positive")),
    Case("save_interval_zero", train("checkpoint.save_interval=0"),
         ("checkpoint.save_interval", "0")),
    # -- divisibility and layout -----------------------------------------------------------
    Case("layers_not_divisible_by_pp", train("model.num_layers=3", "parallel.pp=2"),
         ("model.num_layers", "3", "parallel.pp", "divisible")),
    Case("hidden_not_divisible_by_heads", train("model.num_attention_heads=3",
                                                "model.num_query_groups=3"),
         ("hidden_size", "num_attention_heads", "divisible")),
    Case("heads_not_divisible_by_groups", train("model.num_query_groups=3"),
         ("num_attention_heads", "num_query_groups", "divisible")),
    Case("global_batch_not_divisible", train("training.global_batch_size=5"),
         ("training.global_batch_size", "5", "divisible")),
    Case("vpp_without_pipeline", train("parallel.vpp=2"), ("parallel.vpp", "2")),
    Case("world_size_vs_layout", train("parallel.tp=2"), ("world size", "1", "parallel.tp")),
    Case("check_world_size_vs_layout", check(2, "parallel.tp=4"),
         ("world size", "2", "parallel.tp"), process=True),
    Case("dp_vs_launch", train("parallel.dp=2"), ("parallel.dp", "2")),
    Case("warmup_longer_than_decay", train("optimizer.warmup_iters=100"),
         ("optimizer.warmup_iters", "100")),
    Case("wsd_without_decay_iters", train("optimizer.lr_decay_style=wsd"),
         ("optimizer.lr_wsd_decay_iters", "None", "wsd")),
    Case("wsd_decay_iters_without_wsd", train("optimizer.lr_wsd_decay_iters=2"),
         ("optimizer.lr_wsd_decay_iters", "2", "only", "'cosine'")),
    Case("unknown_lr_decay_style", train("optimizer.lr_decay_style=cosin"),
         ("optimizer.lr_decay_style", "'cosin'", "cosine, linear, wsd")),
    Case("min_lr_above_lr", train("optimizer.min_lr=1"), ("optimizer.min_lr", "1",
                                                          "optimizer.lr")),
    Case("attn_rank_above_hidden", train("model.attn_rank=128"), ("attn_rank", "128",
                                                                  "hidden_size")),
    Case("mlp_rank_above_hidden", train("model.mlp_rank=100"), ("mlp_rank", "100",
                                                                "hidden_size")),
    # The TP split is refused by validation, before a rank starts: by a launch (torchrun
    # reports its own status for a failed rank) and by the launchers' --check alike.
    Case("groups_not_divisible_by_tp", torchrun2("parallel.tp=2", "model.num_query_groups=1"),
         ("num_query_groups", "1", "divisible"), code=None, process=True),
    # the model-shape rules the layers enforce are refused by --check (submit.sh) too
    Case("check_lowrank_recompute_full_mode",
         check(1, "training.recompute=lowrank", "parallel.mode=full"),
         ("recompute 'lowrank'", "naive and boost")),
    Case("check_rank_ratio_above_one", check(1, "model.attn_rank=null", "model.rank_ratio=2"),
         ("attn_rank (128)", "hidden_size (64)", "model.rank_ratio")),
    Case("ffn_not_divisible_by_tp", check(2, "parallel.tp=2", "model.ffn_hidden_size=127"),
         ("ffn_hidden_size", "127", "divisible")),
    # -- data ------------------------------------------------------------------------------
    Case("data_prefix_missing", train(*DATA, "data.data_path=[{case}/nothing]"),
         ("nothing", ".bin")),
    Case("tokenizer_missing", train("data.mock=false", "data.tokenizer_model={case}/no.model",
                                    "data.data_path=[{case}/d]"),
         ("data.tokenizer_model", "no.model", "does not exist"), setup=dataset("d")),
    Case("tokenizer_wrong_kind", train("data.mock=false", "data.tokenizer_model={case}/t.model",
                                       "data.data_path=[{case}/d]"),
         ("data.tokenizer_model", "t.model", "not a SentencePiece model"),
         setup=setups(dataset("d"), write("t.model", "not a model\n"))),
    Case("tokenizer_hf_dir_incomplete",
         train("data.mock=false", "data.tokenizer_type=huggingface",
               "data.tokenizer_model={case}/tok", "data.data_path=[{case}/d]"),
         ("data.tokenizer_model", "tok", "incomplete", "tokenizer.json"),
         setup=setups(dataset("d"), hf_tokenizer_dir("tok", "tokenizer_config.json"))),
    Case("tokenizer_hf_json_broken",
         train("data.mock=false", "data.tokenizer_type=huggingface",
               "data.tokenizer_model={case}/tok", "data.data_path=[{case}/d]"),
         ("data.tokenizer_model", "tok", "cannot be loaded", "huggingface"),
         setup=setups(dataset("d"), hf_tokenizer_dir("tok", "tokenizer.json",
                                                     "tokenizer_config.json")), process=True),
    Case("data_idx_empty", train(*DATA, "data.data_path=[{case}/d]"), ("d.idx", "is empty"),
         setup=dataset("d", _truncate(".idx", 0))),
    Case("data_bin_empty", train(*DATA, "data.data_path=[{case}/d]"), ("d.bin", "is empty"),
         setup=dataset("d", _truncate(".bin", 0))),
    Case("data_idx_bad_header", train(*DATA, "data.data_path=[{case}/d]"),
         ("d.idx", "header"), forbid=("AssertionError",),
         setup=dataset("d", _patch_bytes(".idx", 0, b"XXXX"))),
    Case("data_idx_bad_version", train(*DATA, "data.data_path=[{case}/d]"),
         ("d.idx", "version 7"), setup=dataset("d", _patch_bytes(".idx", 9, b"\x07"))),
    Case("data_idx_bad_dtype", train(*DATA, "data.data_path=[{case}/d]"),
         ("d.idx", "dtype code 99"), setup=dataset("d", _patch_bytes(".idx", 17, b"\x63"))),
    Case("data_idx_truncated", train(*DATA, "data.data_path=[{case}/d]"),
         ("d.idx", "truncated"), setup=dataset("d", _truncate(".idx", 100))),
    Case("data_bin_truncated", train(*DATA, "data.data_path=[{case}/d]"),
         ("d.bin", "bytes", "d.idx"), setup=dataset("d", _truncate(".bin", 1000))),
    Case("data_ids_beyond_tokenizer", train(*DATA, "data.data_path=[{case}/d]"),
         ("token id 5000", "vocabulary of 300"), setup=dataset("d", max_id=5000), process=True),
    # -- output paths (root: permissions do not stop it, so use paths that cannot exist) ----
    Case("run_dir_is_a_file", train("logging.run_dir={case}/f"), ("logging.run_dir", "f",
                                                                  "not a directory"),
         setup=write("f", "x")),
    Case("run_dir_below_a_file", train("logging.run_dir={case}/f/run"),
         ("logging.run_dir", "f/run"), setup=write("f", "x")),
    Case("run_dir_not_writable", train("logging.run_dir=/proc/mboost_run"),
         ("logging.run_dir", "/proc/mboost_run", "writable")),
    Case("checkpoint_save_is_a_file", train("checkpoint.save={case}/f"),
         ("checkpoint.save", "f", "not a directory"), setup=write("f", "x")),
    # -- checkpoints -----------------------------------------------------------------------
    Case("checkpoint_load_missing", train("checkpoint.load={case}/none"),
         ("checkpoint.load", "none")),
    Case("init_from_missing", train("checkpoint.init_from={case}/none"),
         ("checkpoint.init_from", "none", "not a directory")),
    Case("init_from_and_load", train("checkpoint.init_from={case}", "checkpoint.load={case}"),
         ("checkpoint.load", "checkpoint.init_from", "both set")),
    Case("init_from_without_checkpoint", train("checkpoint.init_from={case}/empty"),
         ("checkpoint.init_from", "empty", "holds no checkpoint"),
         setup=lambda ctx: (ctx.case / "empty").mkdir()),
    Case("checkpoint_other_width", resume("model.hidden_size=128"),
         ("shape", "(256, 64)", "(256, 128)", "/ckpt/iter_0000003",
          "model.hidden_size is 64 in the checkpoint, 128 here"),
         setup=checkpoint(), uses_checkpoint=True),
    Case("checkpoint_other_rank", resume("model.attn_rank=8"),
         ("shape", "16", "8"), setup=checkpoint(), uses_checkpoint=True),
    Case("checkpoint_other_mode", resume("parallel.mode=full"),
         ("parallel.mode",), setup=checkpoint(), uses_checkpoint=True),
    Case("checkpoint_other_activation", resume("model.bottleneck_activation=gelu"),
         ("model.bottleneck_activation", "silu", "gelu"), setup=checkpoint(),
         uses_checkpoint=True),
    Case("checkpoint_shard_truncated", resume(), (".distcp", "truncated"),
         setup=checkpoint(_truncate_shard), uses_checkpoint=True),
    Case("checkpoint_shard_corrupted", resume(), (".distcp", "CRC-32"),
         setup=checkpoint(_flip_shard_bytes), uses_checkpoint=True, process=True),
    Case("checkpoint_common_missing", resume(), ("common.pt", "missing"),
         setup=checkpoint(_remove("common.pt")), uses_checkpoint=True),
    Case("tracker_garbage", resume(), ("latest_checkpointed_iteration.txt", "'two'"),
         setup=checkpoint(_tracker("two\n")), uses_checkpoint=True, process=True),
    Case("tracker_missing_iteration", resume(), ("names iteration 99",),
         setup=checkpoint(_tracker("99\n")), uses_checkpoint=True),
    # -- conversion and evaluation tools: arguments before loading, files by name ------------
    Case("generate_negative_max_new_tokens",
         tool("generate.py", "{case}/no_model", "--prompt", "x", "--max-new-tokens", "-3"),
         ("--max-new-tokens", "-3", ">= 1")),
    Case("generate_top_p_zero", tool("generate.py", "{case}/no_model", "--prompt", "x",
                                     "--top-p", "0"), ("--top-p", "0", "(0, 1]")),
    Case("evaluate_jsonl_without_text",
         tool("evaluate.py", "{case}/no_model", "--input", "{case}/t.jsonl"),
         ("t.jsonl:2", "'text'"), setup=write("t.jsonl", '{"text": "ok"}\n{"txt": "no"}\n')),
    Case("evaluate_jsonl_not_json",
         tool("evaluate.py", "{case}/no_model", "--input", "{case}/t.jsonl"),
         ("t.jsonl:1", "not valid JSON"), setup=write("t.jsonl", "{text: 1}\n")),
    Case("evaluate_truncated_safetensors",
         tool("evaluate.py", "{case}/hf", "--input", "{shared}/corpus.txt"),
         ("model.safetensors", "truncated"), setup=hf_dir(_truncate_safetensors), needs=HF),
    Case("evaluate_malformed_config_json",
         tool("evaluate.py", "{case}/hf", "--input", "{shared}/corpus.txt"),
         ("config.json:4", "not valid JSON"), setup=hf_dir(_break_config_json), needs=HF),
    Case("generate_truncated_safetensors", tool("generate.py", "{case}/hf", "--prompt", "x"),
         ("model.safetensors", "truncated"), setup=hf_dir(_truncate_safetensors), needs=HF),
    Case("import_truncated_safetensors",
         tool("import_hf.py", "{case}/hf", "{case}/run", "--config", DEBUG),
         ("model.safetensors", "truncated"), setup=hf_dir(_truncate_safetensors), needs=HF),
    Case("import_malformed_config_json",
         tool("import_hf.py", "{case}/hf", "{case}/run", "--config", DEBUG),
         ("config.json:4", "not valid JSON"), setup=hf_dir(_break_config_json), needs=HF),
    # -- the tools check a checkpoint's completeness as the trainer does --------------------
    Case("generate_truncated_shard", tool("generate.py", "{case}/ckpt", "--prompt", "x"),
         (".distcp", "truncated"), setup=checkpoint(_truncate_shard), uses_checkpoint=True),
    Case("evaluate_half_written_checkpoint",
         tool("evaluate.py", "{case}/ckpt/iter_0000003.tmp", "--input", "{shared}/corpus.txt"),
         ("iter_0000003.tmp", "manifest.json", "not committed"),
         setup=checkpoint(_half_written), uses_checkpoint=True),
    Case("export_common_state_missing", tool("export_hf.py", "{case}/ckpt", "{case}/out"),
         ("common.pt", "missing"), setup=checkpoint(_remove("common.pt")), uses_checkpoint=True,
         needs=HF),
    Case("export_negative_shard_size",
         tool("export_hf.py", "{case}/no_ckpt", "{case}/run", "--max-shard-size=-1GB"),
         ("--max-shard-size", "'-1GB'", "positive size")),
    Case("export_tokenizer_wrong_kind",
         tool("export_hf.py", "{case}/ckpt", "{case}/run", "--tokenizer", "{case}/t.model"),
         ("--tokenizer", "t.model", "not a SentencePiece model"),
         setup=setups(checkpoint(), write("t.model", "not a model\n")), uses_checkpoint=True,
         needs=HF),
    # -- a setting the tool would ignore, a mode list that names nothing -------------------
    Case("import_shape_override_ignored",
         tool("import_hf.py", "{case}/hf", "{case}/run", "--config", DEBUG,
              "model.hidden_size=128"),
         ("model.hidden_size=128", "from the HF model"), setup=hf_dir(), needs=HF),
    Case("import_checkpoint_override_ignored",
         tool("import_hf.py", "{case}/hf", "{case}/run", "--config", DEBUG,
              "checkpoint.save={case}/elsewhere"),
         ("checkpoint.save", "ignored", "--run-dir"), setup=hf_dir(), needs=HF),
    Case("benchmark_unknown_mode", tool("benchmark.py", "--config", DEBUG, "--tp", "1",
                                        "--modes", "fulll"),
         ("--modes", "'fulll'", "full, naive, boost")),
    Case("perf_model_no_mode", tool("perf_model.py", "--config", DEBUG, "--modes", ","),
         ("--modes", "no mode")),
    # -- set-up: the request is checked before anything is created or installed ------------
    Case("setup_mcore_outside_range", setup_env(MCORE="0.25.0"),
         ("MCORE=0.25.0", "megatron-core>=0.16,<0.20"), process=True),
    # this interpreter is the one asked for: the rule applies to Pythons before 3.12 (the
    # compatibility tier's 3.12 checks the range case above instead)
    *([Case("setup_mcore_needs_newer_python", setup_env(MCORE="0.19.2"),
            ("MCORE=0.19.2", "Python >= 3.12"), process=True)]
      if sys.version_info < (3, 12) else []),
    Case("setup_unknown_extra", setup_env(EXTRAS="plot,evall"),
         ("'evall'", "pyproject.toml", "eval"), process=True),
    # -- tools -----------------------------------------------------------------------------
    Case("preprocess_no_input", tool("preprocess_data.py", "--input", "{case}/none.txt",
                                     "--tokenizer-model", "{tok}", "--output-prefix",
                                     "{case}/out"), ("none.txt",), code=None),
    Case("preprocess_no_tokenizer", tool("preprocess_data.py", "--input", "{shared}/corpus.txt",
                                         "--tokenizer-model", "{case}/no.model",
                                         "--output-prefix", "{case}/out"),
         ("no.model", "does not exist"), code=None),
    Case("preprocess_zero_workers", tool("preprocess_data.py", "--input", "{shared}/corpus.txt",
                                         "--tokenizer-model", "{tok}", "--output-prefix",
                                         "{case}/out", "--workers", "0"),
         ("--workers", "0"), code=None, process=True),
    Case("preprocess_tokenizer_wrong_kind",
         tool("preprocess_data.py", "--input", "{shared}/corpus.txt", "--tokenizer-model",
              "{case}/t.model", "--output-prefix", "{case}/out"),
         ("--tokenizer-model", "t.model", "not a SentencePiece model"), code=None,
         setup=write("t.model", "not a model\n")),
    Case("preprocess_binary_input",
         tool("preprocess_data.py", "--input", "{case}/in", "--tokenizer-model", "{tok}",
              "--output-prefix", "{case}/out"), ("b.dat", "binary", "NUL"), code=None,
         setup=setups(lambda ctx: (ctx.case / "in").mkdir(),
                      write("in/a.txt", "to be\n"), write("in/b.dat", b"\x89PNG\r\n\x00\x00"))),
    Case("tokenizer_not_utf8_input",
         tool("train_tokenizer.py", "--input", "{case}/l1.txt", "--vocab-size", "300",
              "--model-prefix", "{case}/spm"), ("l1.txt", "not UTF-8"), code=None,
         setup=write("l1.txt", "caf\xe9 au lait\n".encode("latin-1") * 10)),
    Case("tokenizer_no_input", tool("train_tokenizer.py", "--input", "{case}/none.txt",
                                    "--vocab-size", "300", "--model-prefix", "{case}/spm"),
         ("none.txt",), code=None),
    Case("tokenizer_vocab_not_int", tool("train_tokenizer.py", "--input", "{shared}/corpus.txt",
                                         "--vocab-size", "many", "--model-prefix",
                                         "{case}/spm"), ("--vocab-size", "many")),
    Case("verify_parallel_bad_mode", tool("verify_parallel.py", "--config", DEBUG, "--mode",
                                          "fast"), ("--mode", "fast"), process=True),
    Case("verify_parallel_bad_yaml", tool("verify_parallel.py", "--config", "{case}/c.yaml"),
         ("c.yaml", "is empty"), code=None, setup=write("c.yaml", "")),
    Case("perf_model_unknown_gpu", tool("perf_model.py", "--config", DEBUG, "--gpu", "tpu9"),
         ("tpu9",), code=None),
    Case("perf_model_missing_config", tool("perf_model.py", "--config", "{case}/none.yaml"),
         ("none.yaml", "does not exist"), code=None),
    Case("perf_model_write_missing_file",
         tool("perf_model.py", "--sizing-table", "--write", "{case}/none.md"),
         ("--write", "none.md", "not an existing file")),
    Case("compare_modes_without_config", lambda ctx: ["bash", "scripts/compare_modes.sh"],
         ("compare_modes.sh", "no config", "usage"), process=True),
    Case("regenerate_results_unknown_item",
         lambda ctx: ["bash", "scripts/regenerate_results.sh", "benchmarks"],
         ("unknown item 'benchmarks'", "known: bench"), process=True),
    Case("regenerate_results_without_environment",
         lambda ctx: ["env", f"VENV={ctx.case}/none", "bash", "scripts/regenerate_results.sh",
                      "bench"], ("no environment", "none", "scripts/setup_env.sh"),
         process=True),
    Case("comm_volume_unknown_key", tool("comm_volume.py", "--config", DEBUG, "model.nope=1"),
         ("unknown key 'nope'",), code=None),
    Case("benchmark_bad_recompute", tool("benchmark.py", "--config", DEBUG, "--tp", "1",
                                         "--recompute", "sometimes"),
         ("--recompute", "sometimes"), process=True),
    # -- values accepted that would do nothing or harm (config/inert_settings.py) ----------
    Case("norm_epsilon_nan", train("model.norm_epsilon=nan"),
         ("model.norm_epsilon", "nan", "finite")),
    Case("norm_epsilon_inf", train("model.norm_epsilon=inf"),
         ("model.norm_epsilon", "inf", "finite")),
    Case("muon_key_with_adamw", train("optimizer.muon_momentum=0.9"),
         ("optimizer.muon_momentum", "0.9", "optimizer.name: muon", "'adamw'")),
    Case("overlap_chunks_beyond_positions", train("parallel.bottleneck_overlap_chunks=33"),
         ("parallel.bottleneck_overlap_chunks", "33", "32 sequence positions")),
    Case("wandb_dir_is_a_file", train("logging.wandb.project=p", "logging.wandb.dir={case}/f"),
         ("logging.wandb.dir", "f", "not a directory"), setup=write("f", "x")),
    # -- one bad input of every entry point (tests/test_entry_points.py finds them) ---------
    Case("benchmark_json_not_writable",
         tool("benchmark.py", "--config", DEBUG, "--json", "/proc/mboost.json"),
         ("--json", "/proc/mboost.json", "cannot create")),
    Case("layer_ops_json_not_writable",
         tool("layer_ops.py", "--config", DEBUG, "--json", "/proc/mboost.json"),
         ("--json", "/proc/mboost.json", "cannot create")),
    Case("paper_table_unknown_row", tool("paper_table.py", "--rows", "99B"),
         ("99B", "choose from")),
    Case("init_time_repeats_not_a_number", tool("init_time.py", "--repeats", "many"),
         ("--repeats", "many")),
    Case("checkpoint_cost_unknown_option", tool("checkpoint_cost.py", "--bogus"), ("--bogus",)),
    Case("precision_check_unknown_mode", tool("precision_check.py", "--config", DEBUG,
                                              "--modes", "fast"), ("--modes", "fast")),
    Case("plot_runs_unknown_option", tool("plot_runs.py", "{case}/r", "--bogus"), ("--bogus",)),
    Case("summarize_run_unknown_option", tool("summarize_run.py", "{case}/r", "--bogus"),
         ("--bogus",)),
    Case("console_train_zero_processes",
         lambda ctx: [sys.executable, "megatron-boost-train", "--nproc-per-node", "0", DEBUG],
         ("--nproc-per-node", "0")),
    Case("console_env_unknown_option",
         lambda ctx: [sys.executable, "megatron-boost-env", "--bogus"], ("--bogus",)),
    Case("bench_against_commit_zero_runs",
         lambda ctx: [sys.executable, str(ROOT / "scripts" / "bench_against_commit.py"),
                      "--commit", "HEAD", "--runs", "0", "--out", f"{ctx.case}/r.txt"],
         ("--runs", "0")),
    Case("compare_optimizers_iters_not_a_number",
         lambda ctx: [sys.executable, str(ROOT / "scripts" / "compare_optimizers.py"),
                      "--iters", "many"], ("--iters", "many")),
    Case("render_docs_unknown_option",
         lambda ctx: [sys.executable, str(ROOT / "scripts" / "render_docs.py"), "--bogus"],
         ("--bogus",)),
    Case("demo_argument_not_an_override", lambda ctx: ["bash", "scripts/demo.sh", "bogus"],
         ("'bogus'", "section.key=value"), process=True),
    Case("demo_data_two_directories", lambda ctx: ["bash", "scripts/demo_data.sh", "a", "b"],
         ("2 arguments", "one"), process=True),
    Case("import_example_unknown_argument",
         lambda ctx: ["bash", "scripts/import_example.sh", "x"], ("'x'", "takes none"),
         process=True),
    Case("run_local_zero_processes",
         lambda ctx: ["bash", "scripts/run_local.sh", "0", DEBUG], ("<nproc>", "'0'"),
         process=True),
    Case("test_sh_workers_not_a_number",
         lambda ctx: ["env", "TEST_WORKERS=abc", "bash", "scripts/test.sh"],
         ("TEST_WORKERS='abc'",), process=True),
    Case("test_compat_workers_not_a_number",
         lambda ctx: ["env", "TEST_WORKERS=abc", "bash", "scripts/test_compat.sh"],
         ("TEST_WORKERS='abc'",), process=True),
    Case("gpu_check_unknown_option",
         lambda ctx: ["env", f"PYTHON={sys.executable}", "bash", "tools/gpu_check.sh", "--bogus"],
         ("--bogus",), process=True),
    Case("paper_table_sh_gpus_not_a_count",
         lambda ctx: ["env", "MBOOST_GPUS=abc", "bash", "scripts/slurm/paper_table.sh",
                      "--rows", "1B"], ("MBOOST_GPUS='abc'",), process=True),
    Case("pretrain_sbatch_outside_slurm",
         lambda ctx: ["env", "-u", "SLURM_JOB_ID", "bash", "scripts/slurm/pretrain.sbatch",
                      DEBUG],
         ("SLURM_JOB_ID",), process=True),
    Case("submit_missing_config",
         lambda ctx: ["bash", "scripts/slurm/submit.sh", f"{ctx.case}/none.yaml"],
         ("none.yaml", "does not exist"), process=True),
    # -- the resume contract (config/resume_contract.py): the data-loss case ----------
    Case("checkpoint_tied_changed", resume("model.share_embeddings_and_output_weights=true"),
         ("model.share_embeddings_and_output_weights=False", "sets True",
          "checkpoint.init_from="), setup=checkpoint(), uses_checkpoint=True),
    # -- CUDA graphs (config/inert_settings.py check_cuda_graphs) ----------------------------
    Case("cuda_graph_impl_typo", check(1, "training.cuda_graph_impl=loca"),
         ("training.cuda_graph_impl ('loca')", "did you mean 'local'")),
    Case("cuda_graph_with_lowrank_recompute",
         check(1, "training.cuda_graph_impl=local", "training.recompute=lowrank",
               "training.device=cuda"),
         ("training.cuda_graph_impl ('local')", "training.recompute ('lowrank')", "freeze",
          "training.recompute=null")),
    Case("cuda_graph_with_full_recompute",
         check(1, "training.cuda_graph_impl=local", "training.recompute=full",
               "training.device=cuda"),
         ("training.cuda_graph_impl ('local')", "training.recompute ('full')",
          "full-iteration graph")),
    Case("cuda_graph_on_cpu", train("training.cuda_graph_impl=local", "training.device=cpu"),
         ("training.cuda_graph_impl ('local')", "needs a CUDA device", "cuda_graph_impl=none")),
    Case("cuda_graph_on_cpu_by_auto",
         train("training.cuda_graph_impl=local", "training.device=auto"),
         ("training.cuda_graph_impl ('local')", "needs a CUDA device")),
    Case("cuda_graph_transformer_engine", check(1, "training.cuda_graph_impl=transformer_engine"),
         ("training.cuda_graph_impl ('transformer_engine')", "TECudaGraphHelper", "use local")),
    Case("layer_ops_halves_without_boost",
         tool("layer_ops.py", "--config", DEBUG, "--modes", "full", "--halves"),
         ("--halves", "full", "add boost to --modes")),
    Case("layer_ops_halves_odd_micro_batch",
         tool("layer_ops.py", "--config", DEBUG, "--modes", "boost", "--micro-batch-size", "3",
              "--halves"),
         ("--halves", "3", "odd", "even --micro-batch-size")),
    Case("interleave_halves_naive",
         check(2, "parallel.interleave_halves=true", "parallel.mode=naive", "parallel.tp=2",
               "training.micro_batch_size=2", "training.global_batch_size=2"),
         ("parallel.interleave_halves (true)", "parallel.mode=boost", "naive")),
    Case("interleave_halves_odd_micro_batch",
         check(2, "parallel.interleave_halves=true", "parallel.mode=boost", "parallel.tp=2",
               "training.micro_batch_size=3", "training.global_batch_size=3"),
         ("parallel.interleave_halves (true)", "training.micro_batch_size (3)", "even")),
    Case("interleave_halves_with_chunks",
         check(2, "parallel.interleave_halves=true", "parallel.mode=boost", "parallel.tp=2",
               "training.micro_batch_size=2", "training.global_batch_size=2",
               "parallel.bottleneck_overlap_chunks=2"),
         ("parallel.interleave_halves (true)", "parallel.bottleneck_overlap_chunks (2)",
          "choose one")),
    Case("interleave_halves_tp1",
         check(1, "parallel.interleave_halves=true", "parallel.mode=boost", "parallel.tp=1",
               "training.micro_batch_size=2", "training.global_batch_size=2"),
         ("parallel.interleave_halves (true)", "parallel.tp > 1")),
]


# ---------------------------------------------------------------------------------------------
# running and checking
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def shared_inputs(tmp_path_factory, request):
    """The tokenizer, a corpus and (when a selected case needs them) one trained checkpoint
    and a random HF LLaMA directory."""
    shared = tmp_path_factory.mktemp("bad_input_shared")
    _sentencepiece_model(shared)
    (shared / "corpus.txt").write_text("to be or not to be\n" * 50)
    if any(HF == c.needs and not _missing_modules(c) for c in _selected_cases(request)):
        from tests.convert_fixtures import random_llama

        random_llama(shared / "hf")
    if any(c.uses_checkpoint for c in _selected_cases(request)):
        # In this process (pretrain's main shuts its process groups down and leaves CPU mode
        # at its end): the checkpoint is an input here, not the subject, so no interpreter
        # and imports of its own.
        with _environment_of_a_fresh_launch():
            proc = _call_main([sys.executable, ENTRY, "--config", DEBUG,
                               "training.train_iters=3", "training.eval_interval=100",
                               f"logging.run_dir={shared / 'trained'}"])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return shared


def _selected_cases(request) -> list:
    # Only this module's cases: other modules may parametrize an argument named "case" too.
    return [item.callspec.params["case"] for item in request.session.items
            if hasattr(item, "callspec")
            and isinstance(item.callspec.params.get("case"), Case)]


def _snapshot(root: Path) -> dict:
    """Every file under ``root`` with its size and CRC-32 ({} when root does not exist)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size, zlib.crc32(p.read_bytes()))
            for p in sorted(root.rglob("*")) if p.is_file()}


#: The entry-point file of a command line -> the module whose ``main(argv)`` it runs.
MAINS = {"pretrain_lowrank.py": "megatron_boost.cli.pretrain",
         **{p.name: f"megatron_boost.cli.{p.stem}" for p in (ROOT / "tools").glob("*.py")},
         # entry points whose main is not a tools/ wrapper of megatron_boost.cli (the
         # repository root is on the path: tools/ and scripts/ import as namespace packages)
         "init_time.py": "tools.init_time",
         **{p.name: f"scripts.{p.stem}" for p in (ROOT / "scripts").glob("*.py")},
         "megatron-boost-train": "megatron_boost.cli.launch",
         "megatron-boost-env": "megatron_boost.cli.env"}


def _runs_in_process(case: Case, argv: list) -> bool:
    return not case.process and len(argv) > 1 and Path(argv[1]).name in MAINS


def _call_main(argv: list) -> subprocess.CompletedProcess:
    """``main(argv[2:])`` of the entry point ``argv[1]`` in this process, as a subprocess would
    report it: the exit status (``SystemExit`` included) and both streams. An exception that
    escapes ``main`` is printed as a traceback, as the interpreter would."""
    main = importlib.import_module(MAINS[Path(argv[1]).name]).main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv[2:])
        except SystemExit as exit_:  # sys.exit(msg) prints msg and exits 1, as here
            code = 0 if exit_.code is None else exit_.code
            if not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - reported like an uncaught exception
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def _prepare(case: Case, tmp_root: Path, shared: Path) -> Ctx:
    ctx = Ctx(case=tmp_root / case.name, shared=shared)
    ctx.case.mkdir(parents=True)
    if case.setup is not None:
        case.setup(ctx)
    return ctx


def _run_case(case: Case, ctx: Ctx) -> dict:
    start = time.perf_counter()
    before = _snapshot(ctx.ckpt)
    argv = case.argv(ctx)
    if _runs_in_process(case, argv):
        proc = _call_main(argv)
    else:
        proc = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True,
                              timeout=TIMEOUT)
    return {"proc": proc, "ctx": ctx, "before": before, "after": _snapshot(ctx.ckpt),
            "seconds": time.perf_counter() - start}


def _missing_modules(case: Case) -> list:
    return [m for m in case.needs if importlib.util.find_spec(m) is None]


@pytest.fixture(scope="session")
def results(request, shared_inputs, tmp_path_factory):
    """Run every selected case; name -> outcome. The subprocess cases run ``PARALLEL_CASES``
    at a time in threads while this thread runs the in-process ones, one after another (they
    redirect the process's stdout and stderr)."""
    cases = [c for c in _selected_cases(request) if not _missing_modules(c)]
    root = tmp_path_factory.mktemp("bad_input_cases")
    contexts = {c.name: _prepare(c, root, shared_inputs) for c in cases}
    in_process = [c for c in cases if _runs_in_process(c, c.argv(contexts[c.name]))]
    outcomes = {}
    with ThreadPoolExecutor(PARALLEL_CASES) as pool:
        futures = {c.name: pool.submit(_run_case, c, contexts[c.name])
                   for c in cases if c not in in_process}
        with _environment_of_a_fresh_launch():
            for c in in_process:
                outcomes[c.name] = _run_case(c, contexts[c.name])
    outcomes.update({name: f.result() for name, f in futures.items()})
    return outcomes


@contextlib.contextmanager
def _environment_of_a_fresh_launch():
    """The environment ``_env()`` gives a subprocess, for the in-process cases: no torchrun
    variables, no MBOOST_TRACEBACK."""
    saved = dict(os.environ)
    _replace_environ(_env())
    try:
        yield
    finally:
        _replace_environ(saved)


def _replace_environ(new: dict) -> None:
    """os.environ becomes ``new`` without passing through an empty environment: the subprocess
    cases' threads read it (``_env()``) meanwhile, and one that read it between a clear() and
    an update() ran without PATH and PYTHONPATH."""
    for key in [k for k in os.environ if k not in new]:
        del os.environ[key]
    os.environ.update(new)


def _program_output(proc: subprocess.CompletedProcess) -> str:
    """stdout + stderr without the torchrun launcher's own ChildFailedError report."""
    text = proc.stdout + "\n" + proc.stderr
    launcher = re.search(r"Traceback \(most recent call last\):\n(  .*\n)*?.*ChildFailedError"
                         r"[\s\S]*$", text)
    return text[:launcher.start()] if launcher else text


def test_table_is_large_enough():
    assert len(CASES) >= 40
    assert len({c.name for c in CASES}) == len(CASES)
    # about ten real Python processes (each starts an interpreter and imports torch); the
    # others through main(argv) in this process. A shell script's case starts bash only.
    assert 8 <= sum(c.process and not _runs_a_shell_script(c) for c in CASES) <= 14


def _runs_a_shell_script(case: Case) -> bool:
    return "bash" in case.argv(Ctx(Path("case"), Path("shared")))[:3]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_clear_error(case, results):
    missing = _missing_modules(case)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    outcome = results[case.name]
    proc, ctx = outcome["proc"], outcome["ctx"]
    text = _program_output(proc)
    shown = f"exit {proc.returncode}\n--- output ---\n{text[-3000:]}"
    assert proc.returncode != 0, shown
    if case.code is not None:
        assert proc.returncode == case.code, shown
    lines = [line for line in text.splitlines() if ERROR_LINE.match(line)]
    # under torchrun every rank that raised prints, ranks other than 0 naming themselves, and
    # a rank ended by torchrun (another rank exited first) prints nothing: one message, said
    # once or by several ranks, rank 0 at most once
    errors = sorted(error_messages(lines))
    assert len(errors) == 1, shown
    assert sum(not RANKED_ERROR_LINE.match(line) for line in lines) <= 1, shown
    print(f"\n[{case.name}] exit {proc.returncode} ({outcome['seconds']:.1f} s"
          f"{', a process' if case.process else ''}): {errors[0]}")  # the table, with -s
    for needle in case.needles:
        assert needle in errors[0], (needle, errors[0])
    for word in case.forbid:
        assert word not in errors[0], (word, errors[0])
    assert "Traceback" not in text, shown
    assert not ctx.run.exists(), f"{ctx.run} was created\n{shown}"
    assert outcome["after"] == outcome["before"], f"{ctx.ckpt} changed\n{shown}"
    if case.name == "run_dir_not_writable":
        assert not os.path.exists("/proc/mboost_run")
