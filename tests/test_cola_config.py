"""A low-rank export's config.json means the same model to the CoLA authors' ColaForCausalLM
(github.com/alvin-zyl/CoLA, transformers 4.x) as to ours (docs/design.md §10.17): CoLA's class
takes σ from ``hidden_act``, the MLP gate's activation from ``hidden_act`` unless
``only_lr_act``, one ``rank`` (hidden_size // 4 when absent), and, as transformers 4.x's
LlamaConfig does, RoPE's base from the top-level ``rope_theta`` (10000 when absent). The model
CoLA's class would build is assembled here by those rules, from the exported config.json and
our ColaLinear pieces, and must give the logits of the export as transformers loads it; the
keys the export wrote before (σ in ``lr_act_type`` only, ``hidden_act`` the gate's) must not.
The importer reads the keys of before and of now into the same model. The ``cola-*.yaml``
configs and their ``llama-*.yaml`` twins use CoLA's RMSNorm epsilon."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_boost.config.run import load_run_config

pytestmark = pytest.mark.fast  # the tiers: docs/testing.md

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=48",
         "model.num_attention_heads=4", "model.vocab_size=64", "model.seq_length=16"]
HF_NAME = {"silu": "silu", "identity": "linear"}
TOKENS = torch.arange(3, 15)[None]


def _cfg(sigma: str, gate: bool, *extra: str, ranks=(4, 4)):
    """A run config; rank 4 is not CoLA's default rank (hidden_size // 4 = 8), so a missing
    ``rank`` key shows."""
    return load_run_config(None, SHAPE + [f"model.attn_rank={ranks[0]}",
                                          f"model.mlp_rank={ranks[1]}",
                                          f"model.bottleneck_activation={sigma}",
                                          f"model.mlp_gate_activation={str(gate).lower()}",
                                          *extra])


def _export(cfg, out: Path) -> Path:
    """An export directory as tools/export_hf.py writes it (hf_config + write_hf_dir), of our
    class's seeded weights."""
    from megatron_boost.convert.hf_cola.modeling_cola import ColaForCausalLM
    from megatron_boost.convert.hf_dir import hf_config, write_hf_dir

    torch.manual_seed(0)
    config = hf_config(cfg, 64, cola=True)
    model = ColaForCausalLM(config)
    out.mkdir(parents=True)
    write_hf_dir(out, {k: v.detach().contiguous() for k, v in model.state_dict().items()},
                 config, None)
    return out


def _config_json(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())


def _weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


def _as_cola_reads(keys: dict, state: dict):
    """The model CoLA's ColaForCausalLM builds from the config.json ``keys`` under transformers
    4.x: LLaMA with every projection a bottleneck of ``rank`` (ColaConfig: hidden_size // 4
    when absent) and σ = ``hidden_act``, the gate's activation ``hidden_act`` unless
    ``only_lr_act`` (default true), RoPE's base the top-level ``rope_theta`` (its LlamaConfig
    ignores ``rope_parameters``); lr_act_type, attn_rank, mlp_rank, mlp_gate_act are unread."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.activations import ACT2FN

    from megatron_boost.convert.hf_cola.modeling_cola import (ATTENTION_PROJECTIONS,
                                                              MLP_PROJECTIONS,
                                                              _replace_projections)

    read = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "max_position_embeddings", "tie_word_embeddings", "hidden_act")
    llama = LlamaConfig(**{k: keys[k] for k in read if k in keys},
                        rope_parameters={"rope_type": "default",
                                         "rope_theta": float(keys.get("rope_theta", 10000.0))})
    rank, sigma = keys.get("rank") or keys["hidden_size"] // 4, keys["hidden_act"]
    model = LlamaForCausalLM(llama)
    for layer in model.model.layers:
        _replace_projections(layer.self_attn, ATTENTION_PROJECTIONS, rank, sigma)
        _replace_projections(layer.mlp, MLP_PROJECTIONS, rank, sigma)
        layer.mlp.act_fn = (torch.nn.Identity() if keys.get("only_lr_act", True)
                            else ACT2FN[sigma])
    model.load_state_dict(state, strict=False)  # lm_head.weight absent when tied
    return model.eval()


def _logits(model):
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("gate", [False, True], ids=["no_gate_act", "gate_silu"])
@pytest.mark.parametrize("sigma", ["silu", "identity"])
def test_the_exported_config_json_keys(sigma, gate, tmp_path):
    keys = _config_json(_export(_cfg(sigma, gate, "model.rotary_base=500000"), tmp_path / "hf"))
    assert keys["hidden_act"] == keys["lr_act_type"] == HF_NAME[sigma]
    assert keys["only_lr_act"] is (not gate)
    assert keys["rank"] == keys["attn_rank"] == keys["mlp_rank"] == 4
    assert keys.get("mlp_gate_act") == ("silu" if gate else None)
    assert keys["rope_theta"] == 500000.0
    assert keys["rope_parameters"]["rope_theta"] == 500000.0


def test_two_ranks_write_no_rank(tmp_path):
    keys = _config_json(_export(_cfg("silu", False, ranks=(4, 8)), tmp_path / "hf"))
    assert "rank" not in keys and (keys["attn_rank"], keys["mlp_rank"]) == (4, 8)


@pytest.mark.parametrize("sigma,gate,theta", [("silu", False, 10000), ("silu", True, 10000),
                                              ("identity", False, 10000),
                                              ("silu", False, 500000)])
def test_colas_class_reads_the_exported_config_json_as_transformers_loads_ours(
        sigma, gate, theta, tmp_path):
    from megatron_boost.convert.hf_dir import load_hf_model

    out = _export(_cfg(sigma, gate, f"model.rotary_base={theta}"), tmp_path / "hf")
    ours = load_hf_model(out)  # AutoModelForCausalLM, trust_remote_code: the copied class
    reference = _as_cola_reads(_config_json(out), _weights(out))
    torch.testing.assert_close(_logits(reference), _logits(ours), rtol=0, atol=1e-6)


def _old_keys(keys: dict, gate: bool) -> dict:
    """The config.json the export wrote before: σ only in lr_act_type, the gate's activation in
    hidden_act ("silu" or "linear"), no only_lr_act, mlp_gate_act, rank or rope_theta."""
    old = {k: v for k, v in keys.items()
           if k not in ("only_lr_act", "mlp_gate_act", "rank", "rope_theta")}
    old["hidden_act"] = "silu" if gate else "linear"
    return old


def test_the_keys_written_before_mean_another_model_to_colas_class(tmp_path):
    """Negative control: CoLA's class reads the keys written before as σ = identity (the
    model's rank here is CoLA's default, hidden_size // 4 = 8, which the keys did not say)."""
    from megatron_boost.convert.hf_dir import load_hf_model

    out = _export(_cfg("silu", False, ranks=(8, 8)), tmp_path / "hf")
    reference = _as_cola_reads(_old_keys(_config_json(out), False), _weights(out))
    assert (_logits(reference) - _logits(load_hf_model(out))).abs().max() > 1e-3


def test_a_gate_activation_cola_cannot_express_is_kept_for_ours():
    """σ = identity with the gate's SiLU: CoLA's class would put σ on the gate; ours reads
    mlp_gate_act, and the export says so (cola_reads_it_differently)."""
    from megatron_boost.convert.hf_cola.modeling_cola import ColaForCausalLM
    from megatron_boost.convert.hf_dir import cola_reads_it_differently, hf_config

    cfg = _cfg("identity", True)
    config = hf_config(cfg, 64, cola=True)
    assert config.mlp_gate_act == "silu" and config.hidden_act == "linear"
    assert not config.only_lr_act
    assert cola_reads_it_differently(cfg.model)
    assert not cola_reads_it_differently(_cfg("silu", True).model)
    assert not cola_reads_it_differently(_cfg("identity", False).model)
    gate = ColaForCausalLM(config).model.layers[0].mlp.act_fn
    x = torch.linspace(-3, 3, 7)
    torch.testing.assert_close(gate(x), torch.nn.functional.silu(x))


def _imported(hf_dir: Path, out: Path):
    """(model section, weights) of the checkpoint tools/import_hf.py makes of ``hf_dir``."""
    from megatron_boost.convert import megatron_side as mb
    from megatron_boost.convert.importer import import_hf

    import_hf(str(hf_dir), str(out), str(ROOT / "configs/debug.yaml"), run_dir=str(out) + "-run")
    path = mb.resolve_checkpoint(str(out))
    cfg, _ = mb.saved_run_config(path)
    with mb.single_process():
        model = mb.build_single_model(cfg, mb.saved_vocab_rows(path))
        mb.load_weights(model, path)
        weights = {k: v.detach().clone() for k, v in mb.global_weights(model).items()}
    return cfg.model, weights


@pytest.mark.parametrize("gate", [False, True], ids=["no_gate_act", "gate_silu"])
def test_the_importer_reads_the_keys_of_before_and_now_into_the_same_model(gate, tmp_path):
    new = _export(_cfg("silu", gate), tmp_path / "new")
    old = tmp_path / "old"
    old.mkdir()
    for f in new.iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    (old / "config.json").write_text(json.dumps(_old_keys(_config_json(new), gate), indent=2))
    model_new, weights_new = _imported(new, tmp_path / "ckpt-new")
    model_old, weights_old = _imported(old, tmp_path / "ckpt-old")
    assert model_new.mlp_gate_activation is gate
    assert model_new.bottleneck_activation == "silu"
    assert model_old == model_new
    assert weights_old.keys() == weights_new.keys()
    for key, tensor in weights_new.items():
        assert torch.equal(weights_old[key], tensor), key


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")
                                        if p.name.startswith(("cola-", "llama-"))))
def test_colas_shapes_use_colas_norm_epsilon(name):
    """CoLA's published configs (cola_configs/*.json) all have rms_norm_eps 1e-6; the CoLA
    paper's LLaMA baselines the same."""
    assert load_run_config(str(ROOT / "configs" / name)).model.norm_epsilon == 1e-6
