"""Tests of the data pipeline: tokenizer training, preprocessing, GPT datasets and run plots.

The corpus is generated here (deterministic synthetic "plays"), so the tests need no download.
The tokenizer and the indexed datasets are built once per module to keep the file fast.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import subprocess
import sys

import numpy
import pytest
import torch

from megatron_boost.data.datasets import (
    DataConfig,
    build_gpt_datasets,
    build_tokenizer,
    get_batch,
    parse_blend,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(REPO, "tools")

# Word lists of the synthetic plays ("|"-separated to keep them compact).
_CHARACTERS = "KING|QUEEN|HAMLET|NURSE|FOOL|GHOST|PORTIA|DUKE".split("|")
_SUBJECTS = (
    "the king|my lord|fair lady|this night|the crown|thy father|a fool|the sword|our love|"
    "sweet Juliet|the ghost|your grace|the moon"
).split("|")
_VERBS = (
    "doth speak|hath seen|shall weep|would follow|must answer|cannot sleep|will not yield|"
    "did betray|dreams of|laughs at|calls upon|fears"
).split("|")
_OBJECTS = (
    "the sea|a thousand men|honour and shame|the bitter cold|my heart|the tower|twelve ravens|"
    "his 3 daughters|the garden|an old quarrel"
).split("|")
_ENDINGS = [".", "!", "?", "; alas.", ", I swear it.", ", good sir.", ". Away!"]


def make_play(rng: random.Random, act: int, n_lines: int) -> str:
    """A deterministic pseudo-play: a title and ``n_lines`` lines of speech."""
    lines = [f"ACT {act}. SCENE {rng.randint(1, 5)}. A room in the castle.", ""]
    for _ in range(n_lines):
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        lines.append(f"{rng.choice(_CHARACTERS)}: {sentence.capitalize()}{rng.choice(_ENDINGS)}")
    return "\n".join(lines) + "\n"


def tool_main(script: str):
    """The ``main`` of ``tools/<script>``, to run a CLI in-process (saves a megatron import)."""
    return importlib.import_module(f"megatron_boost.cli.{script[:-3]}").main


def run_tool(script: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``tools/<script>`` with this interpreter and return the finished process."""
    proc = subprocess.run(
        [sys.executable, os.path.join(TOOLS, script), *args],
        capture_output=True,
        text=True,
        timeout=600,  # bounds a hang only (seconds alone; minutes on a busy machine)
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Train docs (12 plays), held-out docs (3 plays), a tokenizer and both indexed datasets."""
    root = tmp_path_factory.mktemp("data")
    rng = random.Random(1234)
    train_dir, valid_dir = root / "train", root / "valid"
    train_dir.mkdir()
    valid_dir.mkdir()
    train_texts = [make_play(rng, i, rng.randint(20, 40)) for i in range(12)]
    valid_texts = [make_play(rng, 100 + i, 15) for i in range(3)]
    for i, text in enumerate(train_texts):
        (train_dir / f"play_{i:02d}.txt").write_text(text, encoding="utf-8")
    for i, text in enumerate(valid_texts):
        (valid_dir / f"held_out_{i}.txt").write_text(text, encoding="utf-8")

    spm_prefix = str(root / "tok" / "spm")
    out = run_tool(
        "train_tokenizer.py", "--input", str(train_dir), "--vocab-size", "400",
        "--model-prefix", spm_prefix, "--num-threads", "1",
    ).stdout
    assert "vocab" in out
    model = spm_prefix + ".model"
    train_prefix, valid_prefix = str(root / "bin" / "train"), str(root / "bin" / "valid")
    # The train set goes through the CLI with a 2-process pool; the held-out set through main()
    # in-process (no pool), which also saves a second megatron import.
    out = run_tool(
        "preprocess_data.py", "--input", str(train_dir / "*.txt"), "--tokenizer-model", model,
        "--output-prefix", train_prefix, "--workers", "2", "--append-eod",
    ).stdout
    assert "12 docs" in out and "tokens/s" in out
    tool_main("preprocess_data.py")(
        ["--input", str(valid_dir), "--tokenizer-model", model, "--output-prefix", valid_prefix,
         "--append-eod"]
    )
    return dict(
        root=root,
        model=model,
        train_texts=train_texts,
        valid_texts=valid_texts,
        train_prefix=train_prefix,
        valid_prefix=valid_prefix,
    )


def test_tokenizer_special_ids_and_round_trip(corpus):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=corpus["model"])
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, 3)
    assert 300 <= sp.get_piece_size() <= 400
    text = corpus["train_texts"][0]
    assert sp.decode(sp.encode(text)) == text  # identity normalization + byte fallback
    assert sp.unk_id() not in sp.encode("Zebra ünïcödé ✓\n  tabs\tand  spaces")

    tokenizer = build_tokenizer(DataConfig(tokenizer_model=corpus["model"]))
    assert tokenizer.vocab_size == sp.get_piece_size()
    assert tokenizer.eod == sp.eos_id()
    assert tokenizer.tokenize(text) == sp.encode(text)


def test_train_tokenizer_rejects_empty_input(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n", encoding="utf-8")
    args = ["--input", str(tmp_path / "empty.txt"), "--model-prefix", str(tmp_path / "spm")]
    proc = run_tool("train_tokenizer.py", *args, "--vocab-size", "400", check=False)
    assert proc.returncode != 0 and "no text found" in proc.stderr


def test_preprocess_round_trip(corpus, tmp_path):
    import sentencepiece as spm
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    sp = spm.SentencePieceProcessor(model_file=corpus["model"])
    ds = IndexedDataset(corpus["train_prefix"])
    assert len(ds) == len(corpus["train_texts"])
    assert ds.index.dtype == numpy.uint16  # vocab < 65500
    for i, text in enumerate(corpus["train_texts"]):
        assert ds[i].tolist() == sp.encode(text) + [sp.eos_id()]

    # JSONL input: one document per line, with --split-sentences storing one sequence per sentence.
    docs = ["First sentence here. Second one!", "Only one sentence", "A? B."]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs), encoding="utf-8")
    prefix = str(tmp_path / "jsonl")
    tool_main("preprocess_data.py")(
        ["--input", str(jsonl), "--json-key", "body", "--tokenizer-model", corpus["model"],
         "--output-prefix", prefix, "--split-sentences", "yes", "--append-eod"]
    )
    ds = IndexedDataset(prefix)
    assert ds.document_indices.tolist() == [0, 2, 3, 5]
    expected = [["First sentence here.", "Second one!"], ["Only one sentence"], ["A?", "B."]]
    flat = [sp.encode(s) for doc in expected for s in doc]
    for j in (1, 2, 4):  # last sentence of each document carries the EOD
        flat[j] = flat[j] + [sp.eos_id()]
    assert [ds[k].tolist() for k in range(len(ds))] == flat


def test_preprocess_with_a_hugging_face_tokenizer_directory(corpus, tmp_path):
    """An HF tokenizer directory (here: the SentencePiece model as converted for the HF export,
    which gives SentencePiece's ids) is accepted, with the pool, and stores exactly the ids and
    end-of-document id that training reads with data.tokenizer_type=huggingface."""
    pytest.importorskip("transformers")
    import sentencepiece as spm
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_boost.convert.tokenizer import hf_tokenizer

    hf_dir = tmp_path / "hf_tok"
    hf_tokenizer(DataConfig(tokenizer_model=corpus["model"])).save_pretrained(str(hf_dir))
    prefix = str(tmp_path / "hf_train")
    out = run_tool("preprocess_data.py", "--input", str(corpus["root"] / "train"),
                   "--tokenizer-model", str(hf_dir), "--output-prefix", prefix,
                   "--workers", "2", "--append-eod").stdout
    assert "12 docs" in out
    sp = spm.SentencePieceProcessor(model_file=corpus["model"])
    training = build_tokenizer(DataConfig(tokenizer_model=str(hf_dir),
                                          tokenizer_type="huggingface"))
    ds = IndexedDataset(prefix)
    assert len(ds) == len(corpus["train_texts"])
    for i, text in enumerate(corpus["train_texts"]):
        assert ds[i].tolist() == list(training.tokenize(text)) + [training.eod]
        assert ds[i].tolist() == sp.encode(text) + [sp.eos_id()]  # the independent reference


def test_build_gpt_datasets_split_shapes_and_batches(corpus, tmp_path):
    cfg = DataConfig(
        data_path=[corpus["train_prefix"]],
        split="8,2,0",
        tokenizer_model=corpus["model"],
        cache_path=str(tmp_path / "cache"),
    )
    tokenizer = build_tokenizer(cfg)
    seq = 32
    train_ds, valid_ds, test_ds = build_gpt_datasets(cfg, tokenizer, seq, 1234, 40, 4, 0)
    assert test_ds is None  # weight 0 in the split
    assert len(train_ds) >= 40 and len(valid_ds) >= 4
    sample = train_ds[0]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}  # no attention mask
    assert sample["tokens"].shape == (seq,) and sample["labels"].shape == (seq,)
    # tokens and labels are one window of seq+1 tokens shifted by one.
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])

    # The sample is a window of the concatenated documents (seq + 1 consecutive tokens).
    all_ids = numpy.concatenate(
        [tokenizer.tokenize(t) + [tokenizer.eod] for t in corpus["train_texts"]]
    ).tolist()
    window = sample["tokens"].tolist() + sample["labels"][-1:].tolist()
    assert any(all_ids[k : k + seq + 1] == window for k in range(len(all_ids) - seq))

    loader = torch.utils.data.DataLoader(train_ds, batch_size=4, num_workers=cfg.num_workers)
    batch = get_batch(iter(loader))
    for key in ("tokens", "labels", "position_ids"):
        assert batch[key].shape == (4, seq) and batch[key].dtype == torch.int64
    assert batch["loss_mask"].shape == (4, seq) and batch["loss_mask"].dtype == torch.float32
    assert get_batch(None) is None


def test_build_gpt_datasets_separate_validation_and_blend(corpus, tmp_path):
    tokenizer = build_tokenizer(DataConfig(tokenizer_model=corpus["model"]))
    # Held-out validation set: validation reads only the held-out plays.
    cfg = DataConfig(
        data_path=[corpus["train_prefix"]],
        valid_data_path=[corpus["valid_prefix"]],
        tokenizer_model=corpus["model"],
        cache_path=str(tmp_path / "cache"),
    )
    train_ds, valid_ds, test_ds = build_gpt_datasets(cfg, tokenizer, 16, 7, 10, 2, None)
    assert test_ds is None
    assert valid_ds.dataset.path_prefix == corpus["valid_prefix"]
    assert train_ds.dataset.path_prefix == corpus["train_prefix"]
    # Weighted blend of two prefixes with a cache path, without torch.distributed.
    assert not torch.distributed.is_initialized()
    blend = ["0.7", corpus["train_prefix"], "0.3", corpus["valid_prefix"]]
    cfg = DataConfig(
        data_path=blend,
        split="2,1,0",
        tokenizer_model=corpus["model"],
        cache_path=str(tmp_path / "c2"),
    )
    train_ds, valid_ds, _ = build_gpt_datasets(cfg, tokenizer, 16, 7, 30, 4, 0)
    assert len(train_ds) >= 30 and train_ds[0]["tokens"].shape == (16,)
    assert len(valid_ds) >= 4
    # 3 held-out documents split 9:1 leave no validation document: an error, not Megatron's hang.
    cfg.split = "9,1,0"
    with pytest.raises(
        ValueError, match=r"leaves the valid split of prefix '.*valid' \(3 documents\)"
    ):
        build_gpt_datasets(cfg, tokenizer, 16, 7, 30, 4, 0)


def test_build_gpt_datasets_with_process_group_and_mock(corpus, tmp_path):
    import torch.distributed as dist

    tokenizer = build_tokenizer(DataConfig(tokenizer_model=corpus["model"]))
    cfg = DataConfig(
        data_path=[corpus["train_prefix"]],
        split="9,1,0",
        tokenizer_model=corpus["model"],
        cache_path=str(tmp_path / "cache"),
    )
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        train_ds, valid_ds, _ = build_gpt_datasets(cfg, tokenizer, 16, 3, 8, 2, 0)
    finally:
        dist.destroy_process_group()
    assert len(train_ds) >= 8 and valid_ds[0]["tokens"].shape == (16,)

    mock = DataConfig(mock=True, mock_vocab_size=128)
    train_ds, valid_ds, test_ds = build_gpt_datasets(mock, build_tokenizer(mock), 16, 0, 8, 2, 2)
    sample = train_ds[0]
    assert sample["tokens"].shape == (16,) and int(sample["tokens"].max()) < 128


def test_data_config_validate_errors(corpus, tmp_path):
    missing = str(tmp_path / "nope" / "data")
    cfg = DataConfig(data_path=[missing], tokenizer_model=corpus["model"])
    with pytest.raises(
        ValueError, match=r"prefix '.*nope/data' has no .*\.bin/\.idx.*preprocess_data"
    ):
        cfg.validate()
    cfg = DataConfig(data_path=[corpus["train_prefix"]], tokenizer_model=str(tmp_path / "x.model"))
    with pytest.raises(
        ValueError, match=r"tokenizer_model '.*x\.model' does not exist.*train_tokenizer"
    ):
        cfg.validate()
    with pytest.raises(ValueError, match="tokenizer_model is empty"):
        DataConfig(data_path=[corpus["train_prefix"]]).validate()
    with pytest.raises(ValueError, match="pairs"):
        DataConfig(
            data_path=["0.5", corpus["train_prefix"], "0.5"], tokenizer_model=corpus["model"]
        ).validate()
    with pytest.raises(ValueError, match="data.split"):
        DataConfig(
            data_path=[corpus["train_prefix"]], split="a,b", tokenizer_model=corpus["model"]
        ).validate()
    with pytest.raises(ValueError, match="valid_data_path prefix"):
        DataConfig(
            data_path=[corpus["train_prefix"]],
            valid_data_path=[missing],
            tokenizer_model=corpus["model"],
        ).validate()
    DataConfig(data_path=[corpus["train_prefix"]], tokenizer_model=corpus["model"]).validate()
    DataConfig(mock=True).validate()
    assert parse_blend("0.3 a 0.7 b") == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["a", "b"]) == (["a", "b"], None)


def test_plot_runs(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install matplotlib)")
    runs = []
    for r, scale in (("run_a", 1.0), ("run_b", 0.9)):
        run = tmp_path / r
        run.mkdir()
        lines = []
        for it in range(1, 21):
            rec = dict(
                iteration=it,
                tokens=it * 4096,
                loss=scale * (8 - it * 0.2),
                lr=1e-3,
                grad_norm=1.0,
                tokens_per_s=1000 + 10 * it,
                tflops=0.1,
                mfu=0.01,
                tp_comm_bytes=0,
            )
            if it % 5 == 0:
                rec.update(val_loss=scale * (8.2 - it * 0.2), val_ppl=3000.0)
            lines.append(json.dumps(rec))
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        runs.append(str(run))
    out = tmp_path / "plots" / "curves.png"
    run_tool("plot_runs.py", *runs, "--out", str(out), "--labels", "a", "b")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    (tmp_path / "empty_run").mkdir()
    proc = run_tool("plot_runs.py", str(tmp_path / "empty_run"), "--out", str(out), check=False)
    assert proc.returncode != 0 and "no metrics.jsonl" in proc.stderr
