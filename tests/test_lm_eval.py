"""lm-evaluation-harness on an exported checkpoint: a local multiple-choice task (JSONL + task
YAML, no hub) through ``lm_eval --model hf``; the accuracy it reports and every per-choice
loglikelihood it logs equal ours, computed with the exported HF model on the same items."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

LM_EVAL = shutil.which("lm_eval") or str(Path(os.sys.executable).with_name("lm_eval"))

ITEMS = [
    {"context": "The model is trained", "choices": ["on text", "with care", "by night"],
     "gold": 0},
    {"context": "Tensor parallelism splits", "choices": ["the weights", "a pie", "nothing"],
     "gold": 0},
    {"context": "The checkpoint is saved", "choices": ["to disk", "in the sky"], "gold": 0},
    {"context": "Low rank means", "choices": ["fewer parameters", "more", "blue"], "gold": 1},
    {"context": "Run the tests with", "choices": ["pytest", "a hammer", "luck"], "gold": 2},
]

TASK_YAML = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def our_loglikelihoods(hf_dir: Path, context: str, choices) -> list:
    """log p(" " + choice | context) under the exported model: lm-eval's encoding (the
    continuation is the tail of the joint encoding after the context's ids)."""
    from transformers import AutoTokenizer

    from megatron_boost.convert.hf_dir import load_hf_model

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    model = load_hf_model(hf_dir)
    ctx = tok(context)["input_ids"]
    out = []
    for choice in choices:
        whole = tok(context + " " + choice)["input_ids"]
        ids = torch.tensor([whole])  # [1, s]
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)  # [s, V]
        out.append(sum(float(logp[t - 1, whole[t]]) for t in range(len(ctx), len(whole))))
    return out


def test_lm_eval_multiple_choice_equals_our_loglikelihoods(checkpoint, tmp_path):
    from megatron_boost.cli.export_hf import main as export

    hf = tmp_path / "hf"
    assert export([checkpoint("full_tp2"), str(hf)]) == 0
    data = tmp_path / "tasks" / "tiny.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (data.parent / "tiny_choice.yaml").write_text(TASK_YAML.format(data=data))
    # without the torch.distributed variables that in-process tools left (accelerate would
    # join that stale world)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               HF_DATASETS_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(
        [LM_EVAL, "--model", "hf", "--model_args",
         f"pretrained={hf},trust_remote_code=True,dtype=float32", "--tasks", "tiny_choice",
         "--include_path", str(data.parent), "--device", "cpu", "--batch_size", "1",
         "--output_path", str(tmp_path / "out"), "--log_samples"],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = next(l for l in proc.stdout.splitlines() if l.startswith("|tiny_choice"))
    cells = [c.strip() for c in row.split("|")]
    reported_acc = float(cells[cells.index("acc") + 2])
    logged = [json.loads(l) for f in (tmp_path / "out").rglob("samples_tiny_choice*.jsonl")
              for l in f.read_text().splitlines()]
    assert len(logged) == len(ITEMS)
    correct = 0
    for sample in logged:
        item = ITEMS[sample["doc_id"]]
        ours = our_loglikelihoods(hf, item["context"], item["choices"])
        theirs = [float(resp[0]) for resp in sample["filtered_resps"]]  # logged as text
        # fp32 forward passes of the same model and ids, in another batch shape
        assert theirs == pytest.approx(ours, abs=1e-4), sample["doc_id"]
        correct += int(max(range(len(ours)), key=ours.__getitem__) == item["gold"])
    assert reported_acc == pytest.approx(correct / len(ITEMS), abs=1e-4)
