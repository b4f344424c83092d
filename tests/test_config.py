"""Configuration: validation rules (one test each), strict YAML loading, dotted overrides."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_boost.config.resolved import check_model_rules, resolve_run, to_transformer_config
from megatron_boost.config.modes import TPMode
from megatron_boost.config.run import load_run_config, reference_yaml
from megatron_boost.config.transformer import BoostTransformerConfig

pytestmark = pytest.mark.fast  # the tiers: docs/testing.md

ROOT = Path(__file__).resolve().parents[1]


def cfg(**kw):
    base = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                tensor_model_parallel_size=2, tp_mode="boost", attn_rank=16, mlp_rank=16,
                add_bias_linear=False)
    base.update(kw)
    return BoostTransformerConfig(**base)


@pytest.mark.parametrize("kw,needle", [
    (dict(tp_mode="naive", attn_rank=18, tensor_model_parallel_size=4),
     "attn_rank (18) must be divisible by tensor_model_parallel_size (4)"),
    (dict(tp_mode="naive", mlp_rank=10, tensor_model_parallel_size=4),
     "mlp_rank (10) must be divisible by tensor_model_parallel_size (4)"),
    (dict(num_attention_heads=6, hidden_size=96, tensor_model_parallel_size=4),
     "num_attention_heads (6) must be divisible by tensor_model_parallel_size (4)"),
    (dict(num_query_groups=2, tensor_model_parallel_size=4),
     "num_query_groups (2) must be divisible by tensor_model_parallel_size (4)"),
    (dict(hidden_size=66, num_attention_heads=2, kv_channels=32, tensor_model_parallel_size=4),
     "hidden_size (66) must be divisible by tensor_model_parallel_size (4)"),
    (dict(ffn_hidden_size=130, tensor_model_parallel_size=4),
     "ffn_hidden_size (130) must be divisible by tensor_model_parallel_size (4)"),
    (dict(bottleneck_activation="swish2"), "bottleneck_activation ('swish2') is unknown"),
    (dict(attn_rank=None), "attn_rank (None) must be a positive integer"),
    (dict(mlp_rank=0), "mlp_rank (0) must be a positive integer"),
    (dict(attn_rank=128), "attn_rank (128) must not exceed hidden_size (64)"),
    (dict(tp_mode="sideways"), "tp_mode ('sideways') must be one of"),
])
def test_bad_values_raise_value_error_with_numbers(kw, needle):
    with pytest.raises(ValueError) as err:
        cfg(**kw)
    assert needle in str(err.value)


def test_valid_configs_per_mode():
    assert cfg().tp_mode is TPMode.BOOST
    # naive does not shard d, so an odd hidden shard is fine as long as the ranks divide.
    assert cfg(tp_mode="naive", tensor_model_parallel_size=2).tp_mode is TPMode.NAIVE
    full = cfg(tp_mode="full", attn_rank=None, mlp_rank=None)
    assert full.tp_mode is TPMode.FULL


def test_debug_yaml_loads_and_overrides_apply():
    c = load_run_config(str(ROOT / "configs/debug.yaml"),
                        ["model.attn_rank=8", "parallel.tp=2", "parallel.mode=naive",
                         "optimizer.lr=1e-4", "data.data_path=[a, b]"])
    assert c.model.attn_rank == 8 and c.parallel.tp == 2 and c.parallel.mode == "naive"
    assert c.optimizer.lr == 1e-4 and c.data.data_path == ["a", "b"]
    tc = to_transformer_config(resolve_run(c, "cpu"))
    assert tc.attn_rank == 8 and tc.tensor_model_parallel_size == 2


def test_unknown_key_names_key_section_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  hidden_size: 64\n  colour: 3\n")
    with pytest.raises(ValueError) as err:
        load_run_config(str(p))
    msg = str(err.value)
    assert "colour" in msg and "model" in msg and f"{p}:3" in msg
    assert "valid keys" in msg  # nothing close enough to suggest


def test_typo_gets_a_did_you_mean(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("training:\n  micro_batch_size: 2\n\n  global_batch_sise: 8\n")
    with pytest.raises(ValueError) as err:
        load_run_config(str(p))
    assert f"{p}:4" in str(err.value) and "did you mean 'global_batch_size'?" in str(err.value)


@pytest.mark.parametrize("overrides,message", [
    (["training.precision=bf61"],
     "training.precision ('bf61') must be one of auto, fp32, bf16; did you mean 'bf16'?"),
    (["training.recompute=everything"], "training.recompute ('everything') must be one of "
     "null, selective, full, lowrank; null recomputes nothing"),
    (["optimizer.name=adam"], "optimizer.name ('adam') must be one of adamw, muon; "
     "did you mean 'adamw'?"),
    (["optimizer.name=muon", "optimizer.muon_scale=spectal"], "optimizer.muon_scale "
     "('spectal') must be one of spectral, shape, unit_rms; did you mean 'spectral'?"),
    (["logging.wandb.mode=disabled"], "logging.wandb.mode ('disabled') must be one of "
     "offline, online; to log nothing to W&B, leave logging.wandb.project null"),
])
def test_a_value_outside_a_keys_set_names_the_set_and_the_fix(overrides, message):
    """Every key with a fixed set of values says it in one form: the key, the value, the
    allowed values, and the one a typo is closest to (else the key's own fix)."""
    with pytest.raises(ValueError) as err:
        load_run_config(None, overrides)
    assert str(err.value) == message


@pytest.mark.parametrize("override,needle", [
    ("training.train_iter=10", "unknown key 'train_iter'"),
    ("trainig.train_iters=10", "unknown section 'trainig'"),
    ("model.hidden_size=abc", "expected int"),
])
def test_override_error_names_the_override_not_the_file(override, needle):
    with pytest.raises(ValueError) as err:
        load_run_config(str(ROOT / "configs/debug.yaml"), [override])
    msg = str(err.value)
    assert needle in msg and f"the override '{override}'" in msg, msg
    assert "debug.yaml" not in msg, msg


def test_wrong_type_in_the_file_names_its_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  num_layers: 2\n  hidden_size: wide\n")
    with pytest.raises(ValueError) as err:
        load_run_config(str(p))
    assert f"{p}:3" in str(err.value) and "model.hidden_size" in str(err.value)


def test_unknown_section_is_fatal(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("modle:\n  hidden_size: 64\n")
    with pytest.raises(ValueError, match="unknown section 'modle'"):
        load_run_config(str(p))


@pytest.mark.parametrize("override,needle", [
    ("parallel.tp", "must look like section.key=value"),
    ("tp=2", "must be dotted"),
    ("parallel.tpp=2", "unknown key 'tpp'"),
])
def test_bad_overrides(override, needle):
    with pytest.raises(ValueError) as err:
        load_run_config(str(ROOT / "configs/debug.yaml"), [override])
    assert needle in str(err.value)


def test_run_level_rules():
    with pytest.raises(ValueError, match=r"num_layers \(2\) must be divisible by parallel.pp"):
        load_run_config(None, ["parallel.pp=4"])
    with pytest.raises(ValueError, match=r"parallel.vpp \(2\) needs parallel.pp >= 2"):
        load_run_config(None, ["parallel.vpp=2"])
    with pytest.raises(ValueError, match="training.precision"):
        load_run_config(None, ["training.precision=fp8"])
    with pytest.raises(ValueError, match="does not exist"):
        load_run_config("no/such/file.yaml")


def test_shipped_configs_load():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        c = load_run_config(str(path))
        check_model_rules(c)


def test_reference_yaml_is_current():
    assert (ROOT / "configs/reference.yaml").read_text() == reference_yaml(), (
        "configs/reference.yaml is stale: python -m megatron_boost.config.run > "
        "configs/reference.yaml")


def test_overlap_bottleneck_grad_reduce_is_settable():
    """The documented switch reaches the megatron config (and the layers read it there)."""
    default = resolve_run(load_run_config(None), "cpu")
    assert to_transformer_config(default).overlap_bottleneck_grad_reduce is True
    cfg = load_run_config(None, ["parallel.overlap_bottleneck_grad_reduce=false"])
    assert to_transformer_config(resolve_run(cfg, "cpu")).overlap_bottleneck_grad_reduce is False


def test_checking_a_configuration_imports_neither_torch_nor_megatron():
    """``--check`` (submit.sh on a login node) loads and validates a configuration without
    torch or megatron-core, which take seconds to import; so does the perf model's refusal of
    a layout. (Its predictions measure the layer with the op ledger, which needs both.)"""
    code = ("import sys\n"
            "from megatron_boost.cli import perf_model, pretrain\n"
            "assert pretrain.main(['--check', '--world-size', '2', '--config',\n"
            "                      'configs/debug.yaml', 'parallel.tp=2']) == 0\n"
            "assert pretrain.main(['--check', '--config', 'configs/debug.yaml',\n"
            "                      'model.hidden_size=3']) == 2\n"
            "assert perf_model.main(['--config', 'configs/debug.yaml', '--tp', '3',\n"
            "                         '--modes', 'boost']) == 2\n"
            "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "[]", proc.stdout[-2000:]


def test_saved_config_is_the_resolved_run(tmp_path):
    """The trainer's config.yaml records the values as used (the tokenizer's vocabulary, not
    model.vocab_size's placeholder; device, precision and attention backend, not auto) and
    resolves to the same run by itself."""
    from megatron_boost.config.resolved import resolved_config_yaml
    from tests.test_training import _sentencepiece_model

    tok = _sentencepiece_model(tmp_path)  # 300 pieces
    cfg = load_run_config(str(ROOT / "configs/debug.yaml"),
                          [f"data.tokenizer_model={tok}", "parallel.tp=2",
                           "training.precision=auto", "training.device=auto"])
    assert cfg.model.vocab_size != 300 and cfg.model.attention_backend == "auto"
    run = resolve_run(cfg, "cpu")
    saved = tmp_path / "config.yaml"
    saved.write_text(resolved_config_yaml(run))
    text = saved.read_text()
    assert "vocabulary 300 (padded to 384 rows for tp=2)" in text
    again = load_run_config(str(saved))
    assert again.model.vocab_size == 300 and again.training.device == "cpu"
    assert again.training.precision == "fp32"
    assert again.model.attention_backend == run.attention_backend != "auto"
    rerun = resolve_run(again)
    assert (rerun.vocab_size, rerun.padded_vocab_size, rerun.device, rerun.precision,
            rerun.attention_backend) == (300, 384, "cpu", "fp32", run.attention_backend)


@pytest.mark.fast
@pytest.mark.parametrize("overrides,on,why", [
    (["parallel.mode=full", "parallel.tp=2"], True, "full mode at tp > 1"),
    (["parallel.mode=full", "parallel.tp=2", "parallel.sequence_parallel=false"], False,
     "the BOOST paper's full-rank baseline"),
    (["parallel.mode=full", "parallel.sequence_parallel=true"], False, "tp=1"),
    (["parallel.mode=boost", "parallel.tp=2"], False, "boost mode"),
    (["parallel.mode=naive", "parallel.tp=2"], False, "naive mode"),
], ids=["full-default", "full-off", "full-tp1", "boost", "naive"])
def test_sequence_parallel_resolves_per_mode(overrides, on, why):
    """megatron's sequence parallelism: on by default for full rank at TP > 1 (as megatron
    users run it), reaching megatron's config; off, with the reason, everywhere else."""
    run = resolve_run(load_run_config(None, overrides), "cpu")
    assert (run.sequence_parallel, to_transformer_config(run).sequence_parallel) == (on, on)
    assert why in run.sequence_parallel_reason


@pytest.mark.fast
@pytest.mark.parametrize("overrides,needle", [
    (["parallel.mode=boost", "parallel.sequence_parallel=true"],
     "does not apply to boost mode: boost's residual stream is already sharded"),
    (["parallel.mode=naive", "parallel.sequence_parallel=true"],
     "does not apply to naive mode"),
    (["parallel.mode=full", "parallel.tp=2", "model.seq_length=33", "model.num_attention_heads=4"],
     "model.seq_length (33) must be divisible by parallel.tp (2) with sequence parallelism"),
], ids=["boost", "naive", "seq-length"])
def test_sequence_parallel_is_refused_where_it_cannot_apply(overrides, needle):
    with pytest.raises(ValueError) as err:
        load_run_config(None, overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)


FUSIONS = ("gradient_accumulation_fusion", "apply_rope_fusion", "masked_softmax_fusion",
           "persist_layer_norm", "bias_activation_fusion")


@pytest.mark.fast
@pytest.mark.parametrize("device,backend,kernels,on", [
    ("cpu", "sdpa", dict(te=True, wgrad_accumulation=True, masked_softmax=True), set()),
    ("cuda", "te", dict(te=True, wgrad_accumulation=True), {"gradient_accumulation_fusion",
                                                            "apply_rope_fusion"}),
    ("cuda", "te", dict(te=True), {"apply_rope_fusion"}),
    ("cuda", "sdpa", dict(wgrad_accumulation=True, masked_softmax=True),
     {"gradient_accumulation_fusion"}),
    ("cuda", "local", dict(masked_softmax=True), {"masked_softmax_fusion"}),
    ("cuda", "local", {}, set()),
], ids=["cpu", "cuda-te-apex", "cuda-te", "cuda-sdpa-apex", "cuda-local-kernel", "cuda-bare"])
def test_fusions_resolve_per_device_and_kernels(device, backend, kernels, on):
    """Each fusion is on exactly where its kernel exists for the device and backend, with the
    reason; the CPU keeps every one off and says so; persist_layer_norm is LayerNorm-only."""
    from megatron_boost.runtime.backends import FusedKernels, format_fusions, resolve_fusions

    got = resolve_fusions(device, backend, FusedKernels(**kernels))
    assert set(got) == set(FUSIONS)
    assert {name for name, (state, _) in got.items() if state} == on
    assert all(why for _, why in got.values())
    if device == "cpu":
        assert got["apply_rope_fusion"][1] == "device cpu: the fused kernels are CUDA's"
    assert "RMSNorm" in got["persist_layer_norm"][1]
    text = format_fusions([(n, s, w) for n, (s, w) in got.items()])
    assert all(n in text for n in FUSIONS)


@pytest.mark.fast
@pytest.mark.parametrize("device,mode,asked,on", [
    ("cuda", "full", None, True), ("cpu", "full", None, False), ("cpu", "full", True, True),
    ("cuda", "full", False, False), ("cuda", "boost", None, False),
    ("cuda", "naive", None, False)])
def test_full_ranks_fused_swiglu_resolves_by_device(device, mode, asked, on):
    """megatron's fused SwiGLU (bias_activation_fusion): on for full rank on CUDA, as megatron
    users run it; off on the CPU unless asked; never for the bottleneck modes, whose MLP
    product is their own fused region. The resolved value reaches megatron's config."""
    from megatron_boost.runtime.backends import FusedKernels, resolve_fusions

    state, why = resolve_fusions(device, "sdpa", FusedKernels(), mode=mode,
                                 bias_activation_fusion=asked)["bias_activation_fusion"]
    assert state is on and why
    cfg = load_run_config(None, [f"parallel.mode={mode}"])
    run = dataclasses.replace(resolve_run(cfg, "cpu"), fusions=(
        ("bias_activation_fusion", on, why),))
    assert to_transformer_config(run).bias_activation_fusion is on


@pytest.mark.fast
def test_fused_swiglu_and_pipelined_all_reduce_belong_to_their_modes():
    with pytest.raises(ValueError, match="model.bias_activation_fusion .true. applies to full"):
        load_run_config(None, ["parallel.mode=boost", "model.bias_activation_fusion=true"])
    with pytest.raises(ValueError, match=r"parallel.bottleneck_overlap_chunks \(2\) needs "
                                         r"parallel.mode=boost"):
        load_run_config(None, ["parallel.mode=naive", "parallel.bottleneck_overlap_chunks=2"])
    with pytest.raises(ValueError, match=r"parallel.bottleneck_overlap_chunks \(0\) must be "
                                         r"positive"):
        load_run_config(None, ["parallel.bottleneck_overlap_chunks=0"])
    load_run_config(None, ["parallel.mode=full", "model.bias_activation_fusion=true"])


@pytest.mark.fast
def test_resolved_fusions_reach_megatrons_config():
    cfg = load_run_config(None, ["model.attention_backend=local"])
    cpu = to_transformer_config(resolve_run(cfg, "cpu"))
    assert not any(getattr(cpu, name) for name in FUSIONS)
    # as resolved on a CUDA device with megatron's softmax kernel (built here on the CPU:
    # resolution is a pure function of the device and the kernels)
    run = dataclasses.replace(resolve_run(cfg, "cpu"), fusions=tuple(
        (n, n == "masked_softmax_fusion", "test") for n in FUSIONS))
    assert to_transformer_config(run).masked_softmax_fusion is True


@pytest.mark.fast
def test_only_initialisation_can_be_left_out_of_the_runs_megatron_config():
    """The config is the run's: a tool may leave the weights uninitialised (it only times a
    layer), and nothing else can be overridden past the one validation pass."""
    run = resolve_run(load_run_config(None, []), "cpu")
    assert to_transformer_config(run).perform_initialization is True
    assert to_transformer_config(run, perform_initialization=False).perform_initialization is False
    with pytest.raises(TypeError):
        to_transformer_config(run, num_layers=1)


def test_cuda_graph_keys_reach_megatrons_config():
    """training.cuda_graph_impl and cuda_graph_scope become megatron's fields of this
    megatron-core version (compat.cuda_graph_fields: cuda_graph_scope, or 0.19's
    cuda_graph_modules). Resolved as a CUDA run would be: the CPU refuses graphs."""
    eager = resolve_run(load_run_config(None), "cpu")
    graphed = load_run_config(None, ["training.cuda_graph_impl=local",
                                     "training.cuda_graph_scope=attn"])
    config = to_transformer_config(dataclasses.replace(eager, cfg=graphed))
    assert config.cuda_graph_impl == "local"
    scope = getattr(config, "cuda_graph_modules", None) or config.cuda_graph_scope
    assert [s.name for s in scope] == ["attn"]
    assert to_transformer_config(eager).cuda_graph_impl == "none"
