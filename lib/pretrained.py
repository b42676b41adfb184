"""The book's one trained model: the tiny character-level GPT on TinyShakespeare, trained once and cached.

Chapters that need a model that has learned something (attention maps with structure, sampling,
a KV cache on real weights) call :func:`tiny_shakespeare_model`. The first call trains the tiny preset
(``GPTConfig.tiny``) with :func:`lib.training.train` for a fixed seed and number of steps, which takes
about two minutes on one CPU thread, and saves it; every later call loads the file in a fraction
of a second. Training runs inside ``torch.random.fork_rng``, so the caller's random state is the same
whether the model was trained or loaded, and a notebook prints the same samples either way.

The cache file lives in ``lib.data.cache_dir() / "models" / <key> / "model.safetensors"``. The key
hashes everything the weights depend on: model and training configs, seed, device type, thread
count, the torch version, the corpus checksum and the source of the library code the computation
runs through (whole modules, and the few data and tokenizer functions it uses). Change any of them and the model is trained afresh. The file is written atomically (temporary name,
then rename), so two processes racing to fill the cache both end with a complete, identical file.

:func:`from_hf` builds a lib :class:`GPT` from someone else's trained weights: a Hugging Face GPT-2 or
Llama state dict and its config dict (:func:`from_hf_folder` reads them from a checkpoint folder).
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lib import data
from lib.model import GPT, GPTConfig
from lib.positional import RotaryEmbedding
from lib.tokenizers import CharTokenizer
from lib.checkpoint import load_checkpoint, save_checkpoint
from lib.config import History, TrainConfig, _device_type
from lib.training import train

__all__ = ["TINY_TRAIN_CONFIG", "PretrainedRun", "tiny_shakespeare_model", "tiny_shakespeare_run", "cache_key",
           "HF_MODEL_TYPES", "from_hf", "from_hf_folder", "hf_config_to_gpt_config", "read_hf_folder"]
_MISSING = object()

# Tuned so the first call trains in about two minutes on one CPU thread (about 1.2M training tokens)
# while the model learns visibly: validation loss near 1.97 nats per character against 3.35 for the
# unigram baseline, past the ~2.5 plateau of a bigram-like model, with heads that attend with structure
# (e.g. a previous-token head in the first layer).
TINY_TRAIN_CONFIG = TrainConfig(
    max_steps=600, batch_size=16, context_length=128, lr=1e-2, min_lr=1e-3, warmup_steps=50,
    weight_decay=0.1, grad_clip=1.0, eval_interval=100, eval_batches=8, seed=0,
)

# Library modules whose code decides the trained weights; their source is part of the cache key.
_CODE = ("model", "config", "block", "attention", "feedforward", "norms", "positional", "loss", "checks",
         "training", "checkpoint")
# From the data and tokenizer modules the run uses only these (the corpus itself is keyed by its
# checksum), so an edit to, say, a download error message does not retrain the model.
_CODE_OBJECTS = (data.train_val_split, data.get_batch, CharTokenizer)
_FORMAT = 1


@dataclass
class PretrainedRun:
    """The trained model and everything about how it came to be."""

    model: GPT
    tokenizer: CharTokenizer
    history: History  # losses during training, for plots
    train_config: TrainConfig
    path: Path  # the cache file
    trained: bool  # True when this call trained the model, False when it loaded it from the cache


def _code_fingerprint() -> str:
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for name in _CODE:
        path = root / f"{name}.py"
        if path.exists():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    for obj in _CODE_OBJECTS:
        digest.update(obj.__qualname__.encode() + b"\0" + inspect.getsource(obj).encode() + b"\0")
    return digest.hexdigest()


def cache_key(model_config: GPTConfig, train_config: TrainConfig, seed: int, device: str = "cpu",
              num_threads: int | None = 1) -> str:
    """The cache folder name for a run: readable prefix plus a hash of everything the weights depend on."""
    if not isinstance(model_config, GPTConfig):
        raise TypeError(f"model_config must be a GPTConfig, got {type(model_config).__name__}")
    if not isinstance(train_config, TrainConfig):
        raise TypeError(f"train_config must be a TrainConfig, got {type(train_config).__name__}")
    material = {
        "format": _FORMAT,
        "model_config": dataclasses.asdict(model_config),
        "train_config": train_config.to_dict(),
        "seed": seed,
        "device": torch.device(device).type,
        "num_threads": num_threads,
        "torch": torch.__version__,
        "corpus": data.TINY_SHAKESPEARE.sha256,
        "code": _code_fingerprint(),
    }
    digest = hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()
    return f"tiny-shakespeare-{digest[:16]}"


def tiny_shakespeare_run(device: str | torch.device = "cpu", train_config: TrainConfig | None = None,
                         seed: int = 0, progress: bool = False, num_threads: int | None = 1) -> PretrainedRun:
    """Load the tiny TinyShakespeare model from the cache, training and caching it first if needed.

    ``train_config`` defaults to :data:`TINY_TRAIN_CONFIG` (its ``seed`` is replaced by ``seed``, which
    also seeds the weight initialisation). The model trains on ``device`` and comes back in eval mode.
    ``num_threads`` is the number of CPU threads torch uses while training (restored afterwards):
    one by default, so that the weights do not depend on how many cores the machine has: a matrix
    product split over another number of threads adds its partial sums in another order, and every
    trained-model number the chapters show would change with it. On an idle 2-core machine two
    threads train about 1.6x faster (docs/benchmarks.md); one thread costs that once per cache.
    ``None`` keeps torch's setting.
    """
    if isinstance(device, torch.device):
        device = str(device)
    if _device_type(device) not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'mps' (optionally with an index), got {device!r}")
    if train_config is None:
        train_config = TINY_TRAIN_CONFIG
    if not isinstance(train_config, TrainConfig):
        raise TypeError(f"train_config must be a TrainConfig or None, got {type(train_config).__name__}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if not isinstance(progress, bool):
        raise ValueError(f"progress must be True or False, got {progress!r}")
    if num_threads is not None and (not isinstance(num_threads, int) or isinstance(num_threads, bool)
                                    or num_threads < 1):
        raise ValueError(f"num_threads must be None or a positive int, got {num_threads!r}")
    train_config = dataclasses.replace(train_config, seed=seed, device=None)

    text = data.load_text()
    tokenizer = CharTokenizer.from_text(text)
    model_config = GPTConfig.tiny(vocab_size=tokenizer.vocab_size)
    key = cache_key(model_config, train_config, seed, device, num_threads)
    path = data.cache_dir() / "models" / key / "model.safetensors"

    with torch.random.fork_rng(devices=_rng_devices(device)):
        _seed(seed, device)
        model = GPT(model_config).to(device)
        if path.exists():
            try:
                checkpoint = load_checkpoint(path, model)
                model.eval()
                return PretrainedRun(model, tokenizer, checkpoint.history, train_config, path, trained=False)
            except ValueError as exc:  # an unreadable cache file is rebuilt, never trusted
                warnings.warn(f"ignoring the unreadable cached model at {path} ({exc}); training it again",
                              stacklevel=2)
                _seed(seed, device)
                model = GPT(model_config).to(device)
        ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
        train_ids, val_ids = data.train_val_split(ids, val_fraction=0.1)
        threads = torch.get_num_threads()
        try:
            if num_threads is not None:
                torch.set_num_threads(num_threads)
            history = train(model, train_ids, val_ids, train_config, progress=progress)
        finally:
            torch.set_num_threads(threads)
    save_checkpoint(path, model, step=train_config.max_steps, train_config=train_config, history=history,
                    extra={"seed": seed, "torch": torch.__version__, "tokenizer_chars": "".join(tokenizer.chars)})
    model.eval()
    return PretrainedRun(model, tokenizer, history, train_config, path, trained=True)


def tiny_shakespeare_model(device: str | torch.device = "cpu", train_config: TrainConfig | None = None,
                           seed: int = 0, progress: bool = False,
                           num_threads: int | None = 1) -> tuple[GPT, CharTokenizer]:
    """The trained tiny character-level model (eval mode) and its tokenizer; see :func:`tiny_shakespeare_run`."""
    run = tiny_shakespeare_run(device=device, train_config=train_config, seed=seed, progress=progress,
                               num_threads=num_threads)
    return run.model, run.tokenizer


def _rng_devices(device: str) -> list:
    """Devices whose RNG ``fork_rng`` must save and restore (CPU is always included)."""
    d = torch.device(device)
    if d.type == "cuda":
        return [d.index if d.index is not None else torch.cuda.current_device()]
    return []


def _seed(seed: int, device: str) -> None:
    """Seed the generators the run draws from (inside ``fork_rng``, so the caller's are untouched)."""
    torch.default_generator.manual_seed(seed)  # weight init happens on the CPU
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed(seed)  # dropout on the GPU


# --- Someone else's trained weights: Hugging Face checkpoints of GPT-2 and Llama ---------------------------
#
# A checkpoint is a flat dict of named tensors plus a config dict. ``from_hf`` reads both and builds the
# lib ``GPT`` they describe, tensor by tensor: every tensor must find its place, every lib parameter must
# be filled, every shape must agree, and every config setting that changes the computation must be one
# lib reproduces. Anything else is a ValueError naming the tensor or the field; nothing is dropped.

HF_MODEL_TYPES = ("gpt2", "llama")
# GPT-2's activation names in Hugging Face configs -> GPTConfig.ffn ('gelu_new' is the tanh formula).
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def _hf_get(hf_config: dict, key: str, default: Any = _MISSING) -> Any:
    """``hf_config[key]`` (or ``default``), or a ValueError naming the missing field."""
    if key in hf_config and hf_config[key] is not None:
        return hf_config[key]
    if default is _MISSING:
        raise ValueError(f"hf_config has no {key!r} field (model_type {hf_config.get('model_type')!r} needs it)")
    return default


def _hf_require(hf_config: dict, key: str, allowed: tuple, default: Any) -> None:
    """A config field lib cannot change must hold one of ``allowed`` (``default`` when absent)."""
    value = hf_config.get(key, default)
    if value not in allowed:
        raise ValueError(f"hf_config[{key!r}] = {value!r} is not supported (lib reproduces only {allowed})")


def _gpt2_config(hf: dict) -> GPTConfig:
    act = _hf_get(hf, "activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        raise ValueError(f"hf_config['activation_function'] must be one of {sorted(_GPT2_ACTIVATIONS)}, got {act!r}")
    _hf_require(hf, "scale_attn_weights", (True,), True)
    _hf_require(hf, "scale_attn_by_inverse_layer_idx", (False,), False)
    _hf_require(hf, "add_cross_attention", (False,), False)
    d_model = _hf_get(hf, "n_embd")
    return GPTConfig(vocab_size=_hf_get(hf, "vocab_size"), context_length=_hf_get(hf, "n_positions"),
                     d_model=d_model, n_layers=_hf_get(hf, "n_layer"), n_heads=_hf_get(hf, "n_head"),
                     d_ff=_hf_get(hf, "n_inner", 4 * d_model), norm="layernorm", ffn=_GPT2_ACTIVATIONS[act],
                     positions="learned", tie_embeddings=bool(_hf_get(hf, "tie_word_embeddings", True)),
                     dropout=0.0, bias=True, norm_eps=float(_hf_get(hf, "layer_norm_epsilon", 1e-5)))


def _llama_rope(hf: dict) -> tuple[float, dict | None]:
    """RoPE base and scaling from either form a config carries: ``rope_theta`` + ``rope_scaling``
    (checkpoints' config.json) or ``rope_parameters`` (what recent ``transformers`` write)."""
    params = hf.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or "rope_theta" not in params:
            raise ValueError(f"hf_config['rope_parameters'] must be a dict with a 'rope_theta' entry, got {params!r}")
        params = dict(params)
        base = params.pop("rope_theta")
        field_name = "rope_parameters"
    else:
        base = _hf_get(hf, "rope_theta", 10000.0)
        params = dict(hf.get("rope_scaling") or {})
        field_name = "rope_scaling"
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"hf_config[{field_name!r}]['partial_rotary_factor'] must be 1.0 (lib rotates whole heads)")
    if rope_type == "default":
        if params:
            raise ValueError(f"hf_config[{field_name!r}] has settings {sorted(params)} that plain RoPE does not use")
        return float(base), None
    if rope_type != "llama3":
        raise ValueError(f"hf_config[{field_name!r}] asks for rope_type {rope_type!r}; lib implements "
                         f"'default' and 'llama3'")
    return float(base), {"rope_type": "llama3", **params}  # GPTConfig checks the keys and values


def _llama_config(hf: dict) -> GPTConfig:
    _hf_require(hf, "hidden_act", ("silu",), "silu")
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise ValueError(f"hf_config has attention_bias={attention_bias} but mlp_bias={mlp_bias}; lib's "
                         f"GPTConfig.bias sets both together")
    d_model, n_heads = _hf_get(hf, "hidden_size"), _hf_get(hf, "num_attention_heads")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * n_heads != d_model:
        raise ValueError(f"hf_config['head_dim'] = {head_dim} but hidden_size / num_attention_heads = "
                         f"{d_model} / {n_heads}; lib needs head_dim * num_attention_heads == hidden_size")
    base, scaling = _llama_rope(hf)
    try:
        return GPTConfig(vocab_size=_hf_get(hf, "vocab_size"),
                         context_length=_hf_get(hf, "max_position_embeddings"), d_model=d_model,
                         n_layers=_hf_get(hf, "num_hidden_layers"), n_heads=n_heads,
                         n_kv_heads=_hf_get(hf, "num_key_value_heads", n_heads),
                         d_ff=_hf_get(hf, "intermediate_size"), norm="rmsnorm", ffn="swiglu",
                         positions="rope", rope_base=base,
                         tie_embeddings=bool(_hf_get(hf, "tie_word_embeddings", False)), dropout=0.0,
                         bias=attention_bias, norm_eps=float(_hf_get(hf, "rms_norm_eps", 1e-6)),
                         rope_scaling=scaling)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"hf_config does not describe a model lib can build: {exc}") from None


def _gpt2_plan(config: GPTConfig, sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """lib parameter name -> tensor, from a GPT-2 state dict (Conv1D weights are (in, out): transposed)."""
    C, L = config.d_model, config.n_layers
    take = _Taker(sd, prefix)
    out = {"tok_emb.weight": take("wte.weight", (config.vocab_size, C)),
           "pos_emb.embedding.weight": take("wpe.weight", (config.context_length, C))}
    for i in range(L):
        h, b = f"h.{i}.", f"blocks.{i}."
        for hf_ln, lib_ln in (("ln_1", "norm1"), ("ln_2", "norm2")):
            out[b + lib_ln + ".weight"] = take(h + hf_ln + ".weight", (C,))
            out[b + lib_ln + ".bias"] = take(h + hf_ln + ".bias", (C,))
        qkv_w = take(h + "attn.c_attn.weight", (C, 3 * C)).t()  # Conv1D (in, out) -> Linear (out, in)
        qkv_b = take(h + "attn.c_attn.bias", (3 * C,))
        for name, w, bias in zip(("q_proj", "k_proj", "v_proj"), qkv_w.split(C, dim=0), qkv_b.split(C)):
            out[b + f"attn.{name}.weight"], out[b + f"attn.{name}.bias"] = w, bias
        out[b + "attn.out_proj.weight"] = take(h + "attn.c_proj.weight", (C, C)).t()
        out[b + "attn.out_proj.bias"] = take(h + "attn.c_proj.bias", (C,))
        out[b + "ffn.fc_in.weight"] = take(h + "mlp.c_fc.weight", (C, config.d_ff)).t()
        out[b + "ffn.fc_in.bias"] = take(h + "mlp.c_fc.bias", (config.d_ff,))
        out[b + "ffn.fc_out.weight"] = take(h + "mlp.c_proj.weight", (config.d_ff, C)).t()
        out[b + "ffn.fc_out.bias"] = take(h + "mlp.c_proj.bias", (C,))
        # Older checkpoints also store the causal mask as a buffer: accepted only if it is one.
        mask = take.optional(h + "attn.bias")
        if mask is not None:
            n = config.context_length
            expected = torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n)
            if tuple(mask.shape) != (1, 1, n, n) or not torch.equal(mask.bool(), expected):
                raise ValueError(f"{prefix}{h}attn.bias is not the causal mask of {n} positions "
                                 f"(shape {tuple(mask.shape)}); lib cannot reproduce another mask")
        take.optional(h + "attn.masked_bias", shape=())  # the fill value for masked scores: no weight
    out["norm_f.weight"] = take("ln_f.weight", (C,))
    out["norm_f.bias"] = take("ln_f.bias", (C,))
    _head(config, take, out, "wte.weight")
    take.finish()
    return out


def _llama_plan(config: GPTConfig, sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """lib parameter name -> tensor, from a Llama state dict (both use the half-split RoPE layout)."""
    C, D = config.d_model, config.head_dim
    H, H_kv, F = config.n_heads, config.kv_heads, config.d_ff
    take = _Taker(sd, prefix)
    out = {"tok_emb.weight": take("embed_tokens.weight", (config.vocab_size, C))}
    inv_freq = RotaryEmbedding(D, config.rope_base, scaling=config.rope_scaling).inv_freq
    for i in range(config.n_layers):
        h, b = f"layers.{i}.", f"blocks.{i}."
        out[b + "norm1.weight"] = take(h + "input_layernorm.weight", (C,))
        out[b + "norm2.weight"] = take(h + "post_attention_layernorm.weight", (C,))
        shapes = {"q_proj": (H * D, C), "k_proj": (H_kv * D, C), "v_proj": (H_kv * D, C), "o_proj": (C, H * D)}
        for name, shape in shapes.items():
            lib_name = b + "attn." + ("out_proj" if name == "o_proj" else name)
            out[lib_name + ".weight"] = take(h + f"self_attn.{name}.weight", shape)
            if config.bias:
                out[lib_name + ".bias"] = take(h + f"self_attn.{name}.bias", (shape[0],))
        for name, lib_name, shape in (("gate_proj", "w_gate", (F, C)), ("up_proj", "w_up", (F, C)),
                                      ("down_proj", "w_down", (C, F))):
            out[b + f"ffn.{lib_name}.weight"] = take(h + f"mlp.{name}.weight", shape)
            if config.bias:
                out[b + f"ffn.{lib_name}.bias"] = take(h + f"mlp.{name}.bias", (shape[0],))
        _check_inv_freq(take.optional(h + "self_attn.rotary_emb.inv_freq", (D // 2,)), inv_freq,
                        prefix + h + "self_attn.rotary_emb.inv_freq")
    _check_inv_freq(take.optional("rotary_emb.inv_freq", (D // 2,)), inv_freq, prefix + "rotary_emb.inv_freq")
    out["norm_f.weight"] = take("norm.weight", (C,))
    _head(config, take, out, "embed_tokens.weight")
    take.finish()
    return out


def _check_inv_freq(stored: torch.Tensor | None, ours: torch.Tensor, name: str) -> None:
    """A stored RoPE frequency buffer (older checkpoints) must agree with the config's frequencies."""
    if stored is not None and not torch.allclose(stored.float().cpu(), ours, rtol=1e-4, atol=0):
        raise ValueError(f"{name} disagrees with the RoPE frequencies that the config's rope_theta and "
                         f"rope_scaling imply")


def _head(config: GPTConfig, take: "_Taker", out: dict[str, torch.Tensor], embedding: str) -> None:
    """The output head: its own matrix when untied; when tied, a stored copy must equal the embedding."""
    shape = (config.vocab_size, config.d_model)
    if not config.tie_embeddings:
        out["lm_head.weight"] = take("lm_head.weight", shape, prefixed=False)
        return
    head = take.optional("lm_head.weight", shape, prefixed=False)
    if head is not None and not torch.equal(head, out["tok_emb.weight"]):
        raise ValueError(f"lm_head.weight differs from {take.prefix}{embedding}, but the config ties them "
                         f"(tie_word_embeddings=True)")


class _Taker:
    """Hands out tensors of a state dict by name, checking shapes, and remembers what was taken so that
    :meth:`finish` can name every tensor nobody asked for."""

    def __init__(self, sd: dict[str, torch.Tensor], prefix: str) -> None:
        self.sd, self.prefix, self.left = sd, prefix, set(sd)

    def __call__(self, name: str, shape: tuple[int, ...], prefixed: bool = True) -> torch.Tensor:
        tensor = self.optional(name, shape, prefixed)
        if tensor is None:
            raise ValueError(f"state_dict has no tensor {(self.prefix if prefixed else '') + name!r}")
        return tensor

    def optional(self, name: str, shape: tuple[int, ...] | None = None, prefixed: bool = True) -> torch.Tensor | None:
        key = (self.prefix if prefixed else "") + name
        if key not in self.sd:
            return None
        tensor = self.sd[key]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state_dict[{key!r}] must be a torch.Tensor, got {type(tensor).__name__}")
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"state_dict[{key!r}] has shape {tuple(tensor.shape)}, but the config implies "
                             f"{tuple(shape)}")
        self.left.discard(key)
        return tensor

    def finish(self) -> None:
        if self.left:
            extra = sorted(self.left)
            raise ValueError(f"state_dict has {len(extra)} tensor(s) the config leaves no place for: "
                             f"{extra[:8]}{' ...' if len(extra) > 8 else ''}")


def hf_config_to_gpt_config(hf_config: dict) -> GPTConfig:
    """The :class:`GPTConfig` a Hugging Face config dict (``model_type`` 'gpt2' or 'llama') describes."""
    if not isinstance(hf_config, dict):
        raise TypeError(f"hf_config must be a dict (config.to_dict() or config.json), got "
                        f"{type(hf_config).__name__}")
    model_type = hf_config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"hf_config['model_type'] must be one of {HF_MODEL_TYPES}, got {model_type!r}")
    return _gpt2_config(hf_config) if model_type == "gpt2" else _llama_config(hf_config)


def from_hf(state_dict: dict[str, torch.Tensor], hf_config: dict, dtype: torch.dtype = torch.float32) -> GPT:
    """A lib :class:`GPT` holding the weights of a Hugging Face GPT-2 or Llama checkpoint (eval mode).

    ``state_dict`` maps tensor names to tensors as ``model.state_dict()`` or a safetensors file gives
    them (with or without the ``transformer.`` / ``model.`` prefix); ``hf_config`` is the config as a
    plain dict (``config.to_dict()`` or the parsed ``config.json``). GPT-2: the fused ``c_attn`` is
    split into q, k, v and the Conv1D weights, stored (in, out), are transposed. Llama: grouped-query
    heads, RMSNorm epsilon, RoPE base and Llama 3 scaling come from the config; Hugging Face's
    half-split rotary layout is lib's, so q and k need no permutation. A missing, extra or misshapen
    tensor, an unknown model type or a setting lib cannot reproduce raises a ValueError naming it.
    Uses only torch: no ``transformers`` needed.
    """
    config = hf_config_to_gpt_config(hf_config)
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict of tensors, got {type(state_dict).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if config.positions == "learned":
        prefix = "transformer." if "transformer.wte.weight" in state_dict else ""
        plan = _gpt2_plan(config, state_dict, prefix)
    else:
        prefix = "model." if "model.embed_tokens.weight" in state_dict else ""
        plan = _llama_plan(config, state_dict, prefix)
    model = GPT(config)
    params = dict(model.named_parameters())  # the tied head is listed once, as tok_emb.weight
    unfilled = sorted(set(params) - set(plan))
    if unfilled or set(plan) - set(params):  # pragma: no cover - the plans above cover every parameter
        raise RuntimeError(f"from_hf left lib parameters unfilled: {unfilled}")
    with torch.no_grad():
        for name, tensor in plan.items():
            params[name].copy_(tensor)
    return model.to(dtype).eval()


def read_hf_folder(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """``(state_dict, config dict)`` from a checkpoint folder as ``save_pretrained`` or the Hub lays it
    out: ``config.json`` and ``model.safetensors`` (or shards listed in ``model.safetensors.index.json``)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"folder {str(folder)!r} has no config.json")
    hf_config = json.loads(config_path.read_text())
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    elif index.is_file():
        files = [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        raise ValueError(f"folder {str(folder)!r} has neither model.safetensors nor "
                         f"model.safetensors.index.json")
    state_dict: dict[str, torch.Tensor] = {}
    for path in files:
        state_dict.update(load_file(str(path)))
    return state_dict, hf_config


def from_hf_folder(folder: str | Path, dtype: torch.dtype = torch.float32) -> GPT:
    """:func:`from_hf` on what :func:`read_hf_folder` reads from ``folder``."""
    return from_hf(*read_hf_folder(folder), dtype=dtype)
