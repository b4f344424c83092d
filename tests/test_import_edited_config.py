"""tools/import_hf.py on an export whose config.json was edited by hand: a rank that no longer
matches the weights and an activation megatron-boost does not know are refused in one line
(the tensor and both shapes; the known activations), nothing written; an export without
``rope_theta`` (hand-written, or from before it was written) imports at transformers' default
base, 10000 (docs/design.md §10.17). In this process through the tool's ``main``."""

import json
from pathlib import Path

import pytest
import yaml

from tests.test_cola_config import _cfg, _export
from tests.test_training import DEBUG

pytest.importorskip("transformers")


def _edited(tmp_path: Path, edit) -> Path:
    hf = _export(_cfg("silu", False), tmp_path / "hf")
    path = hf / "config.json"
    keys = json.loads(path.read_text())
    edit(keys)
    path.write_text(json.dumps(keys, indent=2))
    return hf


def _import(hf: Path, out: Path, capsys) -> tuple:
    from megatron_boost.cli import import_hf

    code = import_hf.main([str(hf), str(out), "--config", DEBUG, "--run-dir", f"{out}-run"])
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if "error:" in line], captured


def _refused(hf: Path, tmp_path: Path, capsys) -> str:
    code, lines, captured = _import(hf, tmp_path / "ckpt", capsys)
    assert code == 2 and len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    assert not (tmp_path / "ckpt").exists()
    return lines[0]


def _rank_six(keys: dict) -> None:
    keys.update(attn_rank=6, rank=6)


def test_a_rank_edited_away_from_the_weights_names_the_tensor_and_both_shapes(tmp_path, capsys):
    line = _refused(_edited(tmp_path, _rank_six), tmp_path, capsys)
    assert "model.safetensors: tensor model.layers.0.self_attn.q_proj.cola_a" in line
    assert "has shape [32, 4], but config.json describes [32, 6]" in line


def test_an_unknown_activation_lists_the_known_ones(tmp_path, capsys):
    line = _refused(_edited(tmp_path, lambda k: k.update(lr_act_type="swish")), tmp_path,
                    capsys)
    assert "lr_act_type 'swish'" in line and "silu, linear, gelu, relu" in line


def test_an_export_without_rope_theta_imports_at_transformers_default_base(tmp_path, capsys):
    def no_rope(keys):
        keys.pop("rope_theta")
        keys.pop("rope_parameters")

    out = tmp_path / "ckpt"
    code, lines, captured = _import(_edited(tmp_path, no_rope), out, capsys)
    assert code == 0 and not lines, captured.err
    train = yaml.safe_load((out / "train.yaml").read_text())
    assert train["model"]["rotary_base"] == 10000
