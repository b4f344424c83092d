"""A low-rank export's config.json means the same model to the CoLA authors' ColaForCausalLM
(github.com/alvin-zyl/CoLA) as to ours (docs/design.md §10.17): CoLA's class takes σ from
``hidden_act``, the MLP gate's activation from ``hidden_act`` unless ``only_lr_act``, and one
``rank``. The model CoLA's class would build is assembled here by those rules, from our
ColaLinear pieces, and must give our class's logits; the keys the export wrote before (σ in
``lr_act_type`` only, ``hidden_act`` the gate's) must not. The importer reads both."""

from __future__ import annotations

import pytest
import torch

from megatron_boost.config.run import load_run_config

pytestmark = pytest.mark.fast  # the tiers: docs/testing.md

SHAPE = ["model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=48",
         "model.num_attention_heads=4", "model.vocab_size=64", "model.seq_length=16",
         "model.attn_rank=8", "model.mlp_rank=8"]


def _cfg(sigma: str, gate: bool):
    return load_run_config(None, SHAPE + [f"model.bottleneck_activation={sigma}",
                                          f"model.mlp_gate_activation={str(gate).lower()}"])


def _ours(cfg):
    from megatron_boost.convert.hf_cola.modeling_cola import ColaForCausalLM
    from megatron_boost.convert.hf_dir import hf_config

    torch.manual_seed(0)
    config = hf_config(cfg, 64, cola=True)
    return ColaForCausalLM(config).eval(), config.to_dict()


def _as_cola_reads(keys: dict, state: dict):
    """The model CoLA's ColaForCausalLM builds from ``keys``: LLaMA with every projection a
    bottleneck of ``rank`` and σ = ``hidden_act``, the gate's activation ``hidden_act`` unless
    ``only_lr_act`` (its modeling_cola.py, ColaMLP and the attention's projections)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.activations import ACT2FN

    from megatron_boost.convert.hf_cola.modeling_cola import (ATTENTION_PROJECTIONS,
                                                              MLP_PROJECTIONS,
                                                              _replace_projections)

    llama = LlamaConfig(**{k: v for k, v in keys.items()
                           if k not in ("architectures", "auto_map", "model_type")})
    model = LlamaForCausalLM(llama)
    for layer in model.model.layers:
        _replace_projections(layer.self_attn, ATTENTION_PROJECTIONS, keys["rank"],
                             keys["hidden_act"])
        _replace_projections(layer.mlp, MLP_PROJECTIONS, keys["rank"], keys["hidden_act"])
        layer.mlp.act_fn = (torch.nn.Identity() if keys.get("only_lr_act", True)
                            else ACT2FN[keys["hidden_act"]])
    model.load_state_dict(state)
    return model.eval()


def _logits(model):
    with torch.no_grad():
        return model(torch.arange(3, 15)[None]).logits


@pytest.mark.parametrize("sigma,gate", [("silu", False), ("silu", True), ("identity", False)])
def test_colas_class_reads_the_exported_keys_as_ours_does(sigma, gate):
    ours, keys = _ours(_cfg(sigma, gate))
    assert keys["hidden_act"] == keys["lr_act_type"] == {"silu": "silu",
                                                         "identity": "linear"}[sigma]
    assert keys["only_lr_act"] is (not gate) and keys["rank"] == 8
    reference = _as_cola_reads(keys, ours.state_dict())
    torch.testing.assert_close(_logits(reference), _logits(ours), rtol=0, atol=1e-6)


def test_the_keys_written_before_mean_another_model_to_colas_class():
    """Negative control: σ only in lr_act_type, hidden_act "linear" for a gate without
    activation (the export before), which CoLA's class reads as σ = identity."""
    ours, keys = _ours(_cfg("silu", False))
    old = dict(keys, hidden_act="linear")
    old.pop("only_lr_act")
    reference = _as_cola_reads(old, ours.state_dict())
    assert (_logits(reference) - _logits(ours)).abs().max() > 1e-3


def test_a_gate_activation_cola_cannot_express_is_kept_for_ours():
    """σ = identity with the gate's SiLU: CoLA's class would put σ on the gate; ours reads
    mlp_gate_act, and the export says so (cola_reads_it_differently)."""
    from megatron_boost.convert.hf_dir import cola_reads_it_differently

    cfg = _cfg("identity", True)
    ours, keys = _ours(cfg)
    assert keys["mlp_gate_act"] == "silu" and keys["hidden_act"] == "linear"
    assert cola_reads_it_differently(cfg.model)
    assert not cola_reads_it_differently(_cfg("silu", True).model)
    gate = ours.model.layers[0].mlp.act_fn
    x = torch.linspace(-3, 3, 7)
    torch.testing.assert_close(gate(x), torch.nn.functional.silu(x))


@pytest.mark.parametrize("gate", [False, True])
def test_the_importer_reads_the_keys_of_before_and_now_alike(gate):
    from megatron_boost.convert.importer import _shape_overrides

    _, keys = _ours(_cfg("silu", gate))
    before = {k: v for k, v in keys.items()
              if k not in ("only_lr_act", "mlp_gate_act", "rank")}
    before["hidden_act"] = "silu" if gate else "linear"
    now = _shape_overrides(keys)
    assert now == _shape_overrides(before)
    assert f"model.mlp_gate_activation={gate}" in now
