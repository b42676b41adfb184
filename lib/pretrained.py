"""Someone else's trained weights: Hugging Face GPT-2 and Llama checkpoints in lib.

A checkpoint is a flat dict of named tensors plus a config dict. :func:`from_hf` reads
both and builds the lib :class:`GPT` they describe, tensor by tensor: every tensor must
find its place, every lib parameter must be filled, every shape must agree, and every
config setting that changes the computation must be one lib reproduces. Anything else is
an error naming the tensor or the field; nothing is dropped. :func:`from_hf_folder`
reads a checkpoint folder as ``save_pretrained`` or the Hub lays it out. Only torch and
safetensors are needed, not ``transformers``.

The book's own trained model (the tiny TinyShakespeare run) is :mod:`lib.tiny_model`'s.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lib.checks import check_type
from lib.model import GPT, GPTConfig
from lib.positional import RotaryEmbedding
from lib.smollm import from_gguf, smollm2_gguf  # a real model from a GGUF file (lib.smollm)

__all__ = ["HF_MODEL_TYPES", "from_hf", "from_hf_folder", "hf_config_to_gpt_config",
           "read_hf_folder", "smollm2_gguf", "from_gguf"]
_MISSING = object()

HF_MODEL_TYPES = ("gpt2", "llama")
# GPT-2's activation names in Hugging Face configs -> GPTConfig.ffn ('gelu_new' is the
# tanh formula).
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                     "gelu": "gelu", "relu": "relu"}


def _hf_get(hf_config: dict, key: str, default: Any = _MISSING) -> Any:
    """``hf_config[key]`` (or ``default``), or a ValueError naming the missing field."""
    if key in hf_config and hf_config[key] is not None:
        return hf_config[key]
    if default is _MISSING:
        raise ValueError(f"hf_config has no {key!r} field (model_type "
                         f"{hf_config.get('model_type')!r} needs it)")
    return default


def _hf_bool(hf_config: dict, key: str, default: bool) -> bool:
    """A true/false field of the config (``default`` when absent)."""
    value = _hf_get(hf_config, key, default)
    if not isinstance(value, bool):
        raise ValueError(f"hf_config[{key!r}] must be true or false, got {value!r}")
    return value


def _hf_require(hf_config: dict, key: str, allowed: tuple, default: Any) -> None:
    """A config field lib cannot change must hold one of ``allowed`` (``default`` when
    absent)."""
    value = hf_config.get(key, default)
    if value not in allowed:
        raise ValueError(f"hf_config[{key!r}] = {value!r} is not supported (lib "
                         f"reproduces only {allowed})")


def _float(value: Any) -> Any:
    """An int or float as a float (an HF config may write 500000 for 500000.0); anything
    else unchanged, for GPTConfig to refuse by name."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if is_number else value


def _build_config(**fields: Any) -> GPTConfig:
    """``GPTConfig(**fields)``; any complaint re-worded for an HF config."""
    try:
        return GPTConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"hf_config does not describe a model lib can build: "
                         f"{exc}") from None


def _gpt2_config(hf: dict) -> GPTConfig:
    act = _hf_get(hf, "activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        raise ValueError(f"hf_config['activation_function'] must be one of "
                         f"{sorted(_GPT2_ACTIVATIONS)}, got {act!r}")
    _hf_require(hf, "scale_attn_weights", (True,), True)
    _hf_require(hf, "scale_attn_by_inverse_layer_idx", (False,), False)
    _hf_require(hf, "add_cross_attention", (False,), False)
    d_model = _hf_get(hf, "n_embd")
    d_ff = _hf_get(hf, "n_inner", None)
    return _build_config(
        vocab_size=_hf_get(hf, "vocab_size"), context_length=_hf_get(hf, "n_positions"),
        d_model=d_model, n_layers=_hf_get(hf, "n_layer"), n_heads=_hf_get(hf, "n_head"),
        d_ff=4 * d_model if d_ff is None and isinstance(d_model, int) else d_ff,
        norm="layernorm", ffn=_GPT2_ACTIVATIONS[act], positions="learned",
        tie_embeddings=_hf_bool(hf, "tie_word_embeddings", True), dropout=0.0,
        bias=True,
        norm_eps=_float(_hf_get(hf, "layer_norm_epsilon", 1e-5)))


def _llama_rope(hf: dict) -> tuple[float, dict | None]:
    """RoPE base and scaling from either form a config carries: ``rope_theta`` +
    ``rope_scaling`` (checkpoints' config.json) or ``rope_parameters`` (what recent
    ``transformers`` write)."""
    params = hf.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or "rope_theta" not in params:
            raise ValueError(f"hf_config['rope_parameters'] must be a dict with a "
                             f"'rope_theta' entry, got {params!r}")
        params = dict(params)
        base = params.pop("rope_theta")
        field = "rope_parameters"
    else:
        base = _hf_get(hf, "rope_theta", 10000.0)
        params = hf.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise ValueError(f"hf_config['rope_scaling'] must be a dict or null, got "
                             f"{params!r}")
        params = dict(params)
        field = "rope_scaling"
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"hf_config[{field!r}]['partial_rotary_factor'] must be 1.0 "
                         f"(lib rotates whole heads)")
    if rope_type == "default":
        if params:
            raise ValueError(f"hf_config[{field!r}] has settings {sorted(params)} that "
                             f"plain RoPE does not use")
        return base, None
    if rope_type != "llama3":
        raise ValueError(f"hf_config[{field!r}] asks for rope_type {rope_type!r}; lib "
                         f"implements 'default' and 'llama3'")
    return base, {"rope_type": "llama3", **params}  # GPTConfig checks keys and values


def _llama_config(hf: dict) -> GPTConfig:
    _hf_require(hf, "hidden_act", ("silu",), "silu")
    attention_bias = _hf_bool(hf, "attention_bias", False)
    mlp_bias = _hf_bool(hf, "mlp_bias", False)
    if attention_bias != mlp_bias:
        raise ValueError(f"hf_config has attention_bias={attention_bias} but mlp_bias="
                         f"{mlp_bias}; lib's GPTConfig.bias sets both together")
    d_model, n_heads = _hf_get(hf, "hidden_size"), _hf_get(hf, "num_attention_heads")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * n_heads != d_model:
        raise ValueError(f"hf_config['head_dim'] = {head_dim} but hidden_size / "
                         f"num_attention_heads = {d_model} / {n_heads}; lib needs "
                         f"head_dim * num_attention_heads == hidden_size")
    base, scaling = _llama_rope(hf)
    return _build_config(
        vocab_size=_hf_get(hf, "vocab_size"),
        context_length=_hf_get(hf, "max_position_embeddings"), d_model=d_model,
        n_layers=_hf_get(hf, "num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=_hf_get(hf, "num_key_value_heads", n_heads),
        d_ff=_hf_get(hf, "intermediate_size"), norm="rmsnorm", ffn="swiglu",
        positions="rope", rope_base=_float(base),
        tie_embeddings=_hf_bool(hf, "tie_word_embeddings", False), dropout=0.0,
        bias=attention_bias, norm_eps=_float(_hf_get(hf, "rms_norm_eps", 1e-6)),
        rope_scaling=scaling)


def _gpt2_plan(config: GPTConfig, sd: dict[str, torch.Tensor],
               prefix: str) -> dict[str, torch.Tensor]:
    """lib parameter name -> tensor, from a GPT-2 state dict (Conv1D weights are stored
    (in, out): transposed)."""
    C, F = config.d_model, config.d_ff
    take = _Taker(sd, prefix)
    out = {"tok_emb.weight": take("wte.weight", (config.vocab_size, C)),
           "pos_emb.embedding.weight": take("wpe.weight", (config.context_length, C))}
    for i in range(config.n_layers):
        h, b = f"h.{i}.", f"blocks.{i}."
        for hf_ln, lib_ln in (("ln_1", "norm1"), ("ln_2", "norm2")):
            out[b + lib_ln + ".weight"] = take(h + hf_ln + ".weight", (C,))
            out[b + lib_ln + ".bias"] = take(h + hf_ln + ".bias", (C,))
        qkv_w = take(h + "attn.c_attn.weight", (C, 3 * C)).t()  # (in, out) -> (out, in)
        qkv_b = take(h + "attn.c_attn.bias", (3 * C,))
        for name, w, bias in zip(("q_proj", "k_proj", "v_proj"),
                                 qkv_w.split(C, dim=0), qkv_b.split(C)):
            out[b + f"attn.{name}.weight"], out[b + f"attn.{name}.bias"] = w, bias
        for hf_name, lib_name, shape in (("attn.c_proj", "attn.out_proj", (C, C)),
                                         ("mlp.c_fc", "ffn.fc_in", (C, F)),
                                         ("mlp.c_proj", "ffn.fc_out", (F, C))):
            out[b + lib_name + ".weight"] = take(h + hf_name + ".weight", shape).t()
            out[b + lib_name + ".bias"] = take(h + hf_name + ".bias", (shape[1],))
        _check_mask(take.optional(h + "attn.bias"), config.context_length, prefix + h)
        take.optional(h + "attn.masked_bias", shape=())  # the fill for masked scores
    out["norm_f.weight"] = take("ln_f.weight", (C,))
    out["norm_f.bias"] = take("ln_f.bias", (C,))
    _head(config, take, out, "wte.weight")
    take.finish()
    return out


def _check_mask(mask: torch.Tensor | None, n: int, where: str) -> None:
    """Older GPT-2 checkpoints store the causal mask as a buffer: it must be one."""
    if mask is None:
        return
    expected = torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n)
    if tuple(mask.shape) != (1, 1, n, n) or not torch.equal(mask.bool(), expected):
        raise ValueError(f"{where}attn.bias is not the causal mask of {n} positions "
                         f"(shape {tuple(mask.shape)}); lib has no other mask")


def _llama_plan(config: GPTConfig, sd: dict[str, torch.Tensor],
                prefix: str) -> dict[str, torch.Tensor]:
    """lib parameter name -> tensor, from a Llama state dict (both use the half-split
    RoPE layout, so q and k are copied as they are)."""
    C, D = config.d_model, config.head_dim
    H, H_kv, F = config.n_heads, config.n_kv_heads or config.n_heads, config.d_ff
    take = _Taker(sd, prefix)
    out = {"tok_emb.weight": take("embed_tokens.weight", (config.vocab_size, C))}
    rope = RotaryEmbedding(D, config.rope_base, scaling=config.rope_scaling)
    inv_freq = rope.inv_freq
    shapes = {"self_attn.q_proj": ("attn.q_proj", (H * D, C)),
              "self_attn.k_proj": ("attn.k_proj", (H_kv * D, C)),
              "self_attn.v_proj": ("attn.v_proj", (H_kv * D, C)),
              "self_attn.o_proj": ("attn.out_proj", (C, H * D)),
              "mlp.gate_proj": ("ffn.w_gate", (F, C)),
              "mlp.up_proj": ("ffn.w_up", (F, C)),
              "mlp.down_proj": ("ffn.w_down", (C, F))}
    for i in range(config.n_layers):
        h, b = f"layers.{i}.", f"blocks.{i}."
        out[b + "norm1.weight"] = take(h + "input_layernorm.weight", (C,))
        out[b + "norm2.weight"] = take(h + "post_attention_layernorm.weight", (C,))
        for hf_name, (lib_name, shape) in shapes.items():
            out[b + lib_name + ".weight"] = take(h + hf_name + ".weight", shape)
            if config.bias:
                out[b + lib_name + ".bias"] = take(h + hf_name + ".bias", (shape[0],))
        name = h + "self_attn.rotary_emb.inv_freq"
        _check_inv_freq(take.optional(name, (D // 2,)), inv_freq, prefix + name)
    stored = take.optional("rotary_emb.inv_freq", (D // 2,))
    _check_inv_freq(stored, inv_freq, prefix + "rotary_emb.inv_freq")
    out["norm_f.weight"] = take("norm.weight", (C,))
    _head(config, take, out, "embed_tokens.weight")
    take.finish()
    return out


def _check_inv_freq(stored: torch.Tensor | None, ours: torch.Tensor, name: str) -> None:
    """A stored RoPE frequency buffer (older checkpoints) must agree with the config."""
    if stored is None:
        return
    if not torch.allclose(stored.float().cpu(), ours, rtol=1e-4, atol=0):
        raise ValueError(f"{name} disagrees with the RoPE frequencies that the "
                         f"config's rope_theta and rope_scaling imply")


def _head(config: GPTConfig, take: "_Taker", out: dict[str, torch.Tensor],
          embedding: str) -> None:
    """The output head: its own matrix when untied; when tied, a stored copy must equal
    the embedding."""
    shape = (config.vocab_size, config.d_model)
    if not config.tie_embeddings:
        out["lm_head.weight"] = take("lm_head.weight", shape, prefixed=False)
        return
    head = take.optional("lm_head.weight", shape, prefixed=False)
    if head is not None and not torch.equal(head, out["tok_emb.weight"]):
        raise ValueError(f"lm_head.weight differs from {take.prefix}{embedding}, but "
                         f"the config ties them (tie_word_embeddings=True)")


class _Taker:
    """Hands out tensors of a state dict by name, checking shapes, and remembers what
    was taken so that :meth:`finish` can name every tensor nobody asked for."""

    def __init__(self, sd: dict[str, torch.Tensor], prefix: str) -> None:
        self.sd, self.prefix, self.left = sd, prefix, set(sd)

    def __call__(self, name: str, shape: tuple[int, ...],
                 prefixed: bool = True) -> torch.Tensor:
        """A weight: it must be there, have ``shape`` and hold floating-point values."""
        tensor = self.optional(name, shape, prefixed)
        key = (self.prefix if prefixed else "") + name
        if tensor is None:
            raise ValueError(f"state_dict has no tensor {key!r}")
        if not tensor.is_floating_point():
            raise ValueError(f"state_dict[{key!r}] must hold floating-point weights, "
                             f"got dtype {tensor.dtype}")
        return tensor

    def optional(self, name: str, shape: tuple[int, ...] | None = None,
                 prefixed: bool = True) -> torch.Tensor | None:
        key = (self.prefix if prefixed else "") + name
        if key not in self.sd:
            return None
        tensor = self.sd[key]
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"state_dict[{key!r}] has shape {tuple(tensor.shape)}, "
                             f"but the config implies {tuple(shape)}")
        self.left.discard(key)
        return tensor

    def finish(self) -> None:
        if self.left:
            extra = sorted(self.left)
            more = " ..." if len(extra) > 8 else ""
            raise ValueError(f"state_dict has {len(extra)} tensor(s) the config leaves "
                             f"no place for: {extra[:8]}{more}")


def _check_state_dict(state_dict: object) -> dict[str, torch.Tensor]:
    """``state_dict`` if it is a dict of names to tensors; else a TypeError."""
    check_type("state_dict", state_dict, dict, "dict of tensors")
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise TypeError(f"state_dict keys must be tensor names (str), got {key!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict[{key!r}] must be a torch.Tensor, got "
                            f"{type(value).__name__}")
    return state_dict


def hf_config_to_gpt_config(hf_config: dict) -> GPTConfig:
    """The :class:`GPTConfig` that a Hugging Face config dict (``model_type`` 'gpt2' or
    'llama') describes."""
    check_type("hf_config", hf_config, dict, "dict (config.to_dict() or config.json)")
    model_type = hf_config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"hf_config['model_type'] must be one of {HF_MODEL_TYPES}, "
                         f"got {model_type!r}")
    return _gpt2_config(hf_config) if model_type == "gpt2" else _llama_config(hf_config)


def from_hf(state_dict: dict[str, torch.Tensor], hf_config: dict,
            dtype: torch.dtype = torch.float32) -> GPT:
    """A lib :class:`GPT` with the weights of a Hugging Face GPT-2 or Llama checkpoint.

    ``state_dict``: tensor names to tensors, as ``model.state_dict()`` or a safetensors
    file gives them (with or without the ``transformer.`` / ``model.`` prefix).
    ``hf_config``: the config as a plain dict (``config.to_dict()`` or ``config.json``).
    GPT-2: the fused ``c_attn`` is split into q, k, v, and the Conv1D weights, stored
    (in, out), are transposed. Llama: grouped-query heads, RMSNorm epsilon, RoPE base
    and Llama 3 scaling come from the config; Hugging Face's half-split rotary layout is
    lib's. A missing, extra or misshapen tensor, an unknown model type or a setting lib
    cannot reproduce raises an error naming it. The model comes back in eval mode.
    """
    state_dict = _check_state_dict(state_dict)
    config = hf_config_to_gpt_config(hf_config)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if config.positions == "learned":
        prefix = "transformer." if "transformer.wte.weight" in state_dict else ""
        plan = _gpt2_plan(config, state_dict, prefix)
    else:
        prefix = "model." if "model.embed_tokens.weight" in state_dict else ""
        plan = _llama_plan(config, state_dict, prefix)
    model = GPT(config)
    params = dict(model.named_parameters())  # a tied head is listed once, as tok_emb
    if set(plan) != set(params):  # pragma: no cover - the plans fill every parameter
        raise RuntimeError(f"unfilled lib parameters: {set(params) - set(plan)}")
    with torch.no_grad():
        for name, tensor in plan.items():
            params[name].copy_(tensor)
    return model.to(dtype).eval()


def read_hf_folder(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """``(state_dict, config dict)`` from a checkpoint folder as ``save_pretrained`` or
    the Hub lays it out: ``config.json`` and ``model.safetensors`` (or the shards listed
    in ``model.safetensors.index.json``)."""
    from safetensors.torch import load_file

    check_type("folder", folder, (str, Path), "str or pathlib.Path")
    folder = Path(folder)
    hf_config = _read_json(folder / "config.json", "config.json")
    if (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    elif (folder / "model.safetensors.index.json").is_file():
        index = _read_json(folder / "model.safetensors.index.json", "the shard index")
        if not isinstance(index.get("weight_map"), dict):
            raise ValueError(f"the shard index in {str(folder)!r} has no 'weight_map'")
        files = [folder / name for name in sorted(set(index["weight_map"].values()))]
        for path in files:
            if not path.is_file():
                raise ValueError(f"the shard index lists {path.name}, which is not in "
                                 f"{str(folder)!r}")
    else:
        raise ValueError(f"folder {str(folder)!r} has neither model.safetensors nor "
                         f"model.safetensors.index.json")
    state_dict: dict[str, torch.Tensor] = {}
    for path in files:
        state_dict.update(load_file(str(path)))
    return state_dict, hf_config


def _read_json(path: Path, what: str) -> dict:
    """A JSON object from ``path``, or a ValueError saying what is missing or wrong."""
    if not path.is_file():
        raise ValueError(f"folder {str(path.parent)!r} has no {path.name}")
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} at {path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} at {path} must hold a JSON object, got "
                         f"{type(value).__name__}")
    return value


def from_hf_folder(folder: str | Path, dtype: torch.dtype = torch.float32) -> GPT:
    """:func:`from_hf` on what :func:`read_hf_folder` reads from ``folder``."""
    return from_hf(*read_hf_folder(folder), dtype=dtype)
