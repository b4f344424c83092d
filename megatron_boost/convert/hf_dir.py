"""Writing and reading Hugging Face model directories (config, safetensors, tokenizer)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict

import torch

from megatron_boost.config.modes import TPMode

__all__ = ["hf_config", "write_hf_dir", "load_hf_model", "read_hf_state_dict",
           "read_config_json", "check_weight_files", "check_weight_shapes", "files_follow_umask", "HF_ACTIVATIONS",
           "COLA_CODE", "cola_keys", "cola_reads_it_differently"]

#: bottleneck σ -> transformers ACT2FN name ("linear" is ACT2FN's identity).
HF_ACTIVATIONS = {"silu": "silu", "identity": "linear", "gelu": "gelu", "relu": "relu"}
#: the self-contained CoLA modeling code copied into low-rank exports.
COLA_CODE = Path(__file__).parent / "hf_cola"
_AUTO_MAP = {"AutoConfig": "configuration_cola.ColaConfig",
             "AutoModelForCausalLM": "modeling_cola.ColaForCausalLM"}


def hf_config(cfg, vocab_rows: int, cola: bool, tokenizer=None):
    """LlamaConfig (full rank, or folded) or ColaConfig of a run's model section."""
    from transformers import LlamaConfig

    from megatron_boost.convert.hf_cola.configuration_cola import ColaConfig

    m = cfg.model
    kwargs = dict(
        vocab_size=vocab_rows, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups or m.num_attention_heads,
        head_dim=m.kv_channels or m.hidden_size // m.num_attention_heads,
        max_position_embeddings=m.seq_length, rms_norm_eps=m.norm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base)},
        initializer_range=m.init_method_std,
        tie_word_embeddings=m.share_embeddings_and_output_weights,
        # LLaMA's MLP gate (full rank, or a fold: linear without mlp_gate_activation); a CoLA
        # config says σ here instead (cola_keys)
        hidden_act="silu" if TPMode.parse(cfg.parallel.mode) is TPMode.FULL
        or m.mlp_gate_activation
        else "linear",
        bos_token_id=getattr(tokenizer, "bos_token_id", None),
        eos_token_id=getattr(tokenizer, "eos_token_id", None),
        pad_token_id=getattr(tokenizer, "pad_token_id", None), dtype="float32")
    if not cola:
        config = LlamaConfig(architectures=["LlamaForCausalLM"], **kwargs)
    else:
        config = ColaConfig(architectures=["ColaForCausalLM"], **{**kwargs, **cola_keys(m)})
        config.auto_map = dict(_AUTO_MAP)
    # transformers 4.x (and so the CoLA authors' ColaForCausalLM) reads RoPE's base from the
    # top-level rope_theta only, 10000 when absent; 5.x reads rope_parameters (and moves a
    # top-level rope_theta there when it loads the file)
    config.rope_theta = float(m.rotary_base)
    return config


def cola_keys(m) -> Dict:
    """The CoLA keys of a low-rank model's config.json, with the meaning CoLA's own
    ``ColaForCausalLM`` gives them (github.com/alvin-zyl/CoLA): ``hidden_act`` is σ of every
    bottleneck, and of the MLP's gate unless ``only_lr_act``; ``rank`` is every projection's
    (written when attn_rank == mlp_rank, the only case it can express). Ours also reads
    ``lr_act_type`` (σ), ``attn_rank``, ``mlp_rank`` and ``mlp_gate_act``, the gate's SiLU
    (docs/design.md §10.17)."""
    attn_rank, mlp_rank = m.resolved_ranks()
    sigma = HF_ACTIVATIONS[m.bottleneck_activation]
    keys = dict(hidden_act=sigma, lr_act_type=sigma, attn_rank=attn_rank, mlp_rank=mlp_rank,
                only_lr_act=not m.mlp_gate_activation,
                mlp_gate_act="silu" if m.mlp_gate_activation else None)
    if attn_rank == mlp_rank:
        keys["rank"] = attn_rank
    return keys


def cola_reads_it_differently(m) -> bool:
    """Whether CoLA's own class would build another model from the config.json: it applies σ
    (``hidden_act``) to the MLP's gate, where ours applies SiLU."""
    return m.mlp_gate_activation and m.bottleneck_activation != "silu"


def _save_safetensors(state: Dict[str, torch.Tensor], out: Path, max_shard_size) -> None:
    """model.safetensors, or model-0000k-of-0000n.safetensors + the index above the limit."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, str(out / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {**split.metadata}, "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _umask() -> int:
    """The process's umask (reading it means setting it; set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def files_follow_umask(out: Path) -> None:
    """Give every file under ``out`` the mode a plain ``open()`` gives under the user's umask
    (0644 under the default 022). safetensors' writer creates its files 0600 whatever the
    umask, and copied files keep their source's mode: an export on a shared filesystem must be
    readable by whoever the user's umask lets read."""
    mode = 0o666 & ~_umask()
    for path in Path(out).rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def write_hf_dir(out: Path, state: Dict[str, torch.Tensor], config, tokenizer,
                 max_shard_size="5GB") -> None:
    """Everything ``from_pretrained`` needs, in ``out`` (which must exist), every file with
    the mode the user's umask gives (:func:`files_follow_umask`)."""
    from transformers import GenerationConfig

    config.save_pretrained(out)
    _save_safetensors(state, out, max_shard_size)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)
    if getattr(config, "auto_map", None):
        for name in ("configuration_cola.py", "modeling_cola.py"):
            shutil.copy(COLA_CODE / name, out / name)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    files_follow_umask(out)


def read_config_json(hf_dir) -> dict:
    """``hf_dir/config.json`` as a dict; a file that is not a JSON object is reported with its
    path and line."""
    path = Path(hf_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno}); "
                         f"an HF model's config.json must be one JSON object") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: holds a JSON {type(config).__name__}, not an object")
    return config


def check_weight_files(hf_dir) -> None:
    """Every ``*.safetensors`` file of ``hf_dir`` has a complete header and is as long as the
    header says (a truncated or damaged file is named here, before transformers reads it)."""
    from safetensors import safe_open

    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as err:  # safetensors raises its own SafetensorError
            raise ValueError(f"{path}: not a readable safetensors file ({err}); it may be "
                             f"truncated or damaged: export or download it again") from None


def _saved_shapes(hf_dir) -> Dict[str, tuple]:
    """tensor name -> (shape, file) of every ``*.safetensors`` file's header (no data read)."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = (tuple(f.get_slice(name).get_shape()), path.name)
    return shapes


def check_weight_shapes(hf_dir, trust_remote_code: bool = True) -> None:
    """The weights have the shapes config.json describes: the model is built on the meta device
    (no memory) and each of its tensors compared with the safetensors headers; a hand-edited
    size or rank is named (tensor, both shapes) before transformers reports its own table."""
    from transformers import AutoConfig, AutoModelForCausalLM

    saved = _saved_shapes(hf_dir)
    if not saved:
        return  # PyTorch .bin weights: no header to read without loading them
    config = AutoConfig.from_pretrained(str(hf_dir), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    for name, tensor in model.state_dict().items():
        shape, file = saved.get(name, (None, None))
        if shape is not None and shape != tuple(tensor.shape):
            raise ValueError(f"{Path(hf_dir) / file}: tensor {name} has shape {list(shape)}, "
                             f"but config.json describes {list(tensor.shape)}; config.json "
                             f"does not match the weights (a size or rank edited?): restore "
                             f"it, or export the model again")


def load_hf_model(path, trust_remote_code: bool = True):
    """An HF causal LM from a local directory, fp32, eval mode. A malformed config.json or
    weight file, or weights of other shapes than config.json says, are reported by name first
    (ValueError)."""
    from transformers import AutoModelForCausalLM

    read_config_json(path)
    check_weight_files(path)
    check_weight_shapes(path, trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=trust_remote_code,
                                                 dtype=torch.float32)
    return model.eval()


def read_hf_state_dict(model) -> Dict[str, torch.Tensor]:
    """Detached parameters of a loaded HF model, by name."""
    return {name: p.detach() for name, p in model.state_dict().items()}
