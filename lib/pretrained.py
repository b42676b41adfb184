"""Someone else's trained weights in lib's GPT: one loader for every source.

Loading is two steps whatever the source:

1. a :class:`GPTConfig` from the source's settings: :func:`hf_config_to_gpt_config` for a
   Hugging Face ``config.json`` (GPT-2 or Llama), :func:`lib.smollm.config_from_gguf` for
   a GGUF file; both Llama readers end in :func:`llama_config`;
2. :func:`fill`: the model's every parameter from the source's tensors, found by name
   (a table per source: :data:`GPT2_NAMES`, :data:`LLAMA_NAMES`,
   ``lib.smollm.GGUF_NAMES``; checkpoints use lib's own names), put in lib's layout
   where the source stores them differently (:func:`gpt2_to_lib`), with every shape and
   the tied head checked in one place. :func:`lib.checkpoint.load_checkpoint` fills
   models the same way.

:func:`from_hf` loads a Hugging Face GPT-2 or Llama checkpoint (a state dict and a config
dict); :func:`from_hf_folder` a folder as ``save_pretrained`` or the Hub lays it out. A
setting lib cannot reproduce, or a tensor that is missing, extra or misshapen, is an
error naming it. Nothing else is dropped: only buffers that lib computes itself (such as
a causal mask or RoPE's inverse frequencies), after a check. Only torch and safetensors
are needed, not ``transformers``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from lib.checks import check_type
from lib.config import GPTConfig
from lib.model import GPT
from lib.positional import rope_inv_freq

__all__ = ["HF_MODEL_TYPES", "GPT2_NAMES", "LLAMA_NAMES", "fill", "rename", "gpt2_to_lib",
           "build_config", "llama_config", "hf_config_to_gpt_config", "from_hf",
           "read_hf_folder", "from_hf_folder"]

HF_MODEL_TYPES = ("gpt2", "llama")
# GPT-2's activation names in Hugging Face configs -> GPTConfig.ffn ('gelu_new' is the
# tanh formula).
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                     "gelu": "gelu", "relu": "relu"}

# lib's module names -> a source's: the top-level modules, "blocks", then the modules
# inside a block. GPT-2 fuses q, k and v into one matrix, c_attn.
GPT2_NAMES = {"tok_emb": "wte", "pos_emb.embedding": "wpe", "norm_f": "ln_f",
              "lm_head": "lm_head", "blocks": "h", "norm1": "ln_1", "norm2": "ln_2",
              "attn.q_proj": "attn.c_attn", "attn.k_proj": "attn.c_attn",
              "attn.v_proj": "attn.c_attn", "attn.out_proj": "attn.c_proj",
              "ffn.fc_in": "mlp.c_fc", "ffn.fc_out": "mlp.c_proj"}
LLAMA_NAMES = {"tok_emb": "embed_tokens", "norm_f": "norm", "lm_head": "lm_head",
               "blocks": "layers", "norm1": "input_layernorm",
               "norm2": "post_attention_layernorm", "attn.q_proj": "self_attn.q_proj",
               "attn.k_proj": "self_attn.k_proj", "attn.v_proj": "self_attn.v_proj",
               "attn.out_proj": "self_attn.o_proj", "ffn.w_gate": "mlp.gate_proj",
               "ffn.w_up": "mlp.up_proj", "ffn.w_down": "mlp.down_proj"}


# --------------------------------------------------------------------------------------
# Filling a model
# --------------------------------------------------------------------------------------


def rename(name: str, names: Mapping[str, str]) -> str:
    """A lib parameter name in a source's naming, by its table ``names``:
    ``blocks.3.attn.q_proj.weight`` -> ``layers.3.self_attn.q_proj.weight``
    (:data:`LLAMA_NAMES`)."""
    module, kind = name.rsplit(".", 1)  # kind: 'weight' or 'bias'
    if module.startswith("blocks."):
        _, i, inner = module.split(".", 2)
        return f"{names['blocks']}.{i}.{names[inner]}.{kind}"
    return f"{names[module]}.{kind}"


def _describe(tensor: Any) -> str:
    if not isinstance(tensor, torch.Tensor):
        return f"a {type(tensor).__name__}"
    return f"a {str(tensor.dtype).removeprefix('torch.')} tensor of shape {tuple(tensor.shape)}"


# A per-tensor layout change, e.g. GPT-2's transposed Conv1D weights.
Convert = Callable[[str, torch.Tensor], torch.Tensor]


def fill(model: nn.Module, tensors: Mapping[str, torch.Tensor], source: str = "tensors",
         name: Callable[[str], str] = str,
         convert: Convert | None = None) -> nn.Module:
    """Copy ``tensors`` into ``model``'s parameters and buffers (its ``state_dict``):
    lib's one way to load weights, from a Hugging Face state dict, GGUF or a checkpoint.

    ``name(lib_name)`` is the key of that entry in ``tensors`` (the identity when they
    use lib's names); ``convert(lib_name, tensor)`` puts a stored tensor in lib's layout
    (a transpose, a slice, a row order). Every entry of the model must be filled with a
    tensor of its shape and kind (floating point or not), and every tensor must be used.
    A tied entry (the head that shares the embedding matrix) may be absent; when present
    it must equal the tensor it shares. Anything else is one ValueError that names every
    problem by ``source`` and name. Returns ``model``.
    """
    state = model.state_dict(keep_vars=True)
    first: dict[int, str] = {}  # each tensor's first name: a tied head is listed twice
    problems, plan, used = [], {}, set()
    for lib_name, target in state.items():
        key, owner = name(lib_name), first.setdefault(id(target), lib_name)
        if key not in tensors:
            if owner == lib_name:
                problems.append(f"{source} has no tensor {key!r}")
            continue
        used.add(key)
        stored = tensors[key]
        if owner != lib_name:  # a tied head stored anyway: it must be the embedding
            other = tensors.get(name(owner), stored)
            both = isinstance(stored, torch.Tensor) and isinstance(other, torch.Tensor)
            if not (both and torch.equal(stored, other)):
                problems.append(f"{key} != {name(owner)}, but the model ties them")
            continue
        try:
            value = stored if convert is None else convert(lib_name, stored)
        except (RuntimeError, AttributeError):  # a layout change that does not fit
            value = None
        if (not isinstance(value, torch.Tensor) or value.shape != target.shape
                or value.is_floating_point() != target.is_floating_point()):
            problems.append(f"{source}[{key!r}] is {_describe(stored)}, but model's "
                            f"{lib_name} is {_describe(target)}")
        plan[lib_name] = value
    problems += [f"{source} has a tensor the model has no place for: {key!r}"
                 for key in tensors if key not in used]
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise ValueError(f"{source}'s tensors do not fit model: "
                         + "; ".join(problems[:8]) + more)
    with torch.no_grad():
        for lib_name, value in plan.items():
            state[lib_name].copy_(value)
    return model


def gpt2_to_lib(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A GPT-2 tensor in lib's layout for parameter ``name``: attention and MLP weights
    are Conv1D, stored (in, out), so they are transposed; q, k and v are the three
    thirds of the fused ``c_attn`` (weight rows and bias)."""
    if ".attn." in name or ".ffn." in name:
        tensor = tensor.t()  # (in, out) -> (out, in); a bias (1-D) stays as it is
        module = name.split(".")[-2]
        if module in ("q_proj", "k_proj", "v_proj"):
            tensor = tensor.chunk(3)[("q_proj", "k_proj", "v_proj").index(module)]
    return tensor


# --------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------


def build_config(source: str, **fields: Any) -> GPTConfig:
    """``GPTConfig(**fields)``; a complaint names ``source``, where the fields came from."""
    try:
        return GPTConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source} does not describe a model lib can build: "
                         f"{exc}") from None


def llama_config(source: str, **fields: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a Llama-architecture model (RMSNorm, SwiGLU, RoPE, no
    dropout) with ``fields`` (sizes, heads, ``rope_base``, ``norm_eps``,
    ``tie_embeddings``, ``bias``, ``rope_scaling``) read from ``source``."""
    return build_config(source, norm="rmsnorm", ffn="swiglu", positions="rope",
                        dropout=0.0, **fields)


def _get(hf: dict, key: str, default: Any = ...) -> Any:
    """``hf[key]`` (or ``default``), or a ValueError naming the missing field."""
    if hf.get(key) is None and default is ...:
        raise ValueError(f"hf_config has no {key!r} field (model_type "
                         f"{hf.get('model_type')!r} needs it)")
    return default if hf.get(key) is None else hf[key]


def _require(hf: dict, key: str, allowed: tuple, default: Any, where: str = "") -> Any:
    """A field lib cannot change must hold one of ``allowed`` (``default`` when absent)."""
    value = hf.get(key, default)
    if value not in allowed:
        raise ValueError(f"hf_config{where}[{key!r}] must be one of {allowed}, got "
                         f"{value!r}")
    return value


def _float(value: Any) -> Any:
    """An int as a float (config.json may write 500000 for 500000.0)."""
    return float(value) if type(value) is int else value


def _gpt2_config(hf: dict) -> GPTConfig:
    act = _require(hf, "activation_function", tuple(_GPT2_ACTIVATIONS), "gelu_new")
    _require(hf, "scale_attn_weights", (True,), True)
    _require(hf, "scale_attn_by_inverse_layer_idx", (False,), False)
    _require(hf, "add_cross_attention", (False,), False)
    d_model = _get(hf, "n_embd")
    d_ff = _get(hf, "n_inner", None)
    return build_config(
        "hf_config", vocab_size=_get(hf, "vocab_size"),
        context_length=_get(hf, "n_positions"), d_model=d_model,
        n_layers=_get(hf, "n_layer"), n_heads=_get(hf, "n_head"),
        d_ff=4 * d_model if d_ff is None and isinstance(d_model, int) else d_ff,
        norm="layernorm", ffn=_GPT2_ACTIVATIONS[act], positions="learned",
        tie_embeddings=_get(hf, "tie_word_embeddings", True), dropout=0.0, bias=True,
        norm_eps=_float(_get(hf, "layer_norm_epsilon", 1e-5)))


def _llama_rope(hf: dict) -> tuple[Any, dict | None]:
    """RoPE base and scaling from either form a config carries: ``rope_theta`` +
    ``rope_scaling`` (checkpoints' config.json) or ``rope_parameters`` (what recent
    ``transformers`` write)."""
    field = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    params = hf.get(field) or {}
    if not isinstance(params, dict):
        raise ValueError(f"hf_config[{field!r}] must be a dict or null, got {params!r}")
    params = {"rope_theta": hf.get("rope_theta") or 10000.0, **params}
    base = params.pop("rope_theta")
    _require(params, "partial_rotary_factor", (1.0,), 1.0, f"[{field!r}]")
    params.pop("partial_rotary_factor", None)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    _require({"rope_type": rope_type}, "rope_type", ("default", "llama3"), None,
             f"[{field!r}]")
    return base, None if rope_type == "default" else {"rope_type": rope_type, **params}


def _llama_config(hf: dict) -> GPTConfig:
    _require(hf, "hidden_act", ("silu",), "silu")
    bias, mlp_bias = _get(hf, "attention_bias", False), _get(hf, "mlp_bias", False)
    if bias != mlp_bias:
        raise ValueError(f"hf_config has attention_bias={bias} but mlp_bias={mlp_bias}; "
                         f"lib's GPTConfig.bias sets both together")
    d_model, n_heads = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
    if hf.get("head_dim") not in (None, d_model // n_heads):
        raise ValueError(f"hf_config['head_dim'] = {hf['head_dim']} but hidden_size / "
                         f"num_attention_heads = {d_model} / {n_heads}; lib needs "
                         f"head_dim * num_attention_heads == hidden_size")
    base, scaling = _llama_rope(hf)
    return llama_config(
        "hf_config", vocab_size=_get(hf, "vocab_size"),
        context_length=_get(hf, "max_position_embeddings"), d_model=d_model,
        n_layers=_get(hf, "num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=_get(hf, "num_key_value_heads", n_heads),
        d_ff=_get(hf, "intermediate_size"), rope_base=_float(base),
        tie_embeddings=_get(hf, "tie_word_embeddings", False), bias=bias,
        norm_eps=_float(_get(hf, "rms_norm_eps", 1e-6)), rope_scaling=scaling)


def hf_config_to_gpt_config(hf_config: dict) -> GPTConfig:
    """The :class:`GPTConfig` that a Hugging Face config dict (``model_type`` 'gpt2' or
    'llama') describes."""
    check_type("hf_config", hf_config, dict, "dict (config.to_dict() or config.json)")
    if _require(hf_config, "model_type", HF_MODEL_TYPES, None) == "gpt2":
        return _gpt2_config(hf_config)
    return _llama_config(hf_config)


# --------------------------------------------------------------------------------------
# Hugging Face checkpoints
# --------------------------------------------------------------------------------------


def _drop_computed(state_dict: dict, config: GPTConfig) -> dict[str, torch.Tensor]:
    """The state dict without the buffers older checkpoints store but lib computes
    (GPT-2's causal mask and its fill value, Llama's RoPE frequencies); each must equal
    what the config implies."""
    n = config.context_length
    freqs = rope_inv_freq(config.head_dim, config.rope_base, config.rope_scaling).float()
    computed = {".attn.bias": ("the causal mask", torch.tril(torch.ones(n, n))[None, None]),
                ".attn.masked_bias": ("", None),  # the value masked scores get
                "rotary_emb.inv_freq": ("the RoPE frequencies", freqs)}
    kept = {}
    for key, tensor in state_dict.items():
        ending = next((e for e in computed if str(key).endswith(e)), None)
        what, expected = computed.get(ending, ("", None))
        if ending is None:
            kept[key] = tensor
        elif expected is not None and (tensor.shape != expected.shape or not
                                       torch.allclose(tensor.float().cpu(), expected,
                                                      rtol=1e-4, atol=0)):
            raise ValueError(f"state_dict[{key!r}] is not {what} that the config implies "
                             f"(its rope_theta, rope_scaling, n_positions)")
    return kept


def from_hf(state_dict: dict[str, torch.Tensor], hf_config: dict,
            dtype: torch.dtype = torch.float32) -> GPT:
    """A lib :class:`GPT` with the weights of a Hugging Face GPT-2 or Llama checkpoint.

    ``state_dict``: tensor names to tensors, as ``model.state_dict()`` or a safetensors
    file gives them (with or without the ``transformer.`` / ``model.`` prefix).
    ``hf_config``: the config as a plain dict (``config.to_dict()`` or ``config.json``).
    GPT-2: the fused ``c_attn`` is split into q, k, v, and the Conv1D weights, stored
    (in, out), are transposed (:func:`gpt2_to_lib`). Llama: grouped-query heads, RMSNorm
    epsilon, RoPE base and Llama 3 scaling come from the config; Hugging Face's
    half-split rotary layout is lib's, so every tensor is copied as it is. A missing,
    extra or misshapen tensor, an unknown model type or a setting lib cannot reproduce
    raises an error naming it. The model comes back in eval mode.
    """
    check_type("state_dict", state_dict, dict, "dict of tensors")
    config = hf_config_to_gpt_config(hf_config)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    gpt2 = config.positions == "learned"
    names, body = (GPT2_NAMES, "transformer.") if gpt2 else (LLAMA_NAMES, "model.")
    prefix = body if f"{body}{rename('tok_emb.weight', names)}" in state_dict else ""

    def hf_name(lib_name: str) -> str:  # the head sits outside the body
        return ("" if "lm_head" in lib_name else prefix) + rename(lib_name, names)

    tensors = _drop_computed(state_dict, config)
    convert = gpt2_to_lib if gpt2 else None
    model = fill(GPT(config), tensors, "state_dict", hf_name, convert)
    return model.to(dtype).eval()


def read_hf_folder(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """``(state_dict, config dict)`` from a checkpoint folder as ``save_pretrained`` or
    the Hub lays it out: ``config.json`` and ``model.safetensors`` (or the shards listed
    in ``model.safetensors.index.json``)."""
    from safetensors.torch import load_file

    check_type("folder", folder, (str, Path), "str or pathlib.Path")
    folder = Path(folder)
    hf_config = json.loads((folder / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        raise ValueError(f"folder {str(folder)!r} has neither model.safetensors nor "
                         f"model.safetensors.index.json")
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        state_dict.update(load_file(str(folder / file)))
    return state_dict, hf_config


def from_hf_folder(folder: str | Path, dtype: torch.dtype = torch.float32) -> GPT:
    """:func:`from_hf` on what :func:`read_hf_folder` reads from ``folder``."""
    return from_hf(*read_hf_folder(folder), dtype=dtype)
