"""lib.pretrained.from_hf: tiny random Hugging Face GPT-2 and Llama models give the same logits and the
same greedy tokens in lib's GPT; bad checkpoints and configs are named in the error.

`transformers` is a test-only dependency; every model here is built from a config (no hub access).
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from lib.config import GPTConfig  # noqa: E402
from lib.positional import check_rope_scaling, llama3_inv_freq, rope_inv_freq  # noqa: E402
from lib.pretrained import from_hf, from_hf_folder, hf_config_to_gpt_config, read_hf_folder  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)
VOCAB = 97
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
          "original_max_position_embeddings": 16}


def random_vectors(model):
    """``model`` with random norm gains (around 1) and biases (around 0): at their initial 1
    and 0 a wrongly mapped norm or bias would leave the logits unchanged."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * (0.1 if "bias" in name else 1.0)
                        + (1.0 if "weight" in name else 0.0))
    return model


def gpt2(tie: bool = True, activation: str = "gelu_new", seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=48, n_embd=32, n_layer=2, n_head=4,
                        activation_function=activation, tie_word_embeddings=tie, bos_token_id=0,
                        eos_token_id=0, layer_norm_epsilon=1e-5)
    return random_vectors(GPT2LMHeadModel(config).eval())


def llama(tie: bool = False, scaling: dict | None = None, kv_heads: int = 2, bias: bool = False,
          seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=48,
                         rms_norm_eps=1e-5, rope_theta=10000.0,
                         rope_scaling=None if scaling is None else dict(scaling),
                         tie_word_embeddings=tie, attention_bias=bias, mlp_bias=bias,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return random_vectors(LlamaForCausalLM(config).eval())


def ids(T: int = 20, B: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def assert_same_model(hf, ours) -> None:
    x = ids()
    with torch.no_grad():
        expected = hf(x).logits
    logits, _ = ours(x)
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-5)
    prompt = x[:1, :5]
    theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert torch.equal(ours.generate(prompt, 12, temperature=0.0), theirs)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("activation", ["gelu_new", "gelu"])
def test_gpt2_logits_and_greedy_tokens_match(tie, activation):
    hf = gpt2(tie, activation)
    ours = from_hf(hf.state_dict(), hf.config.to_dict())
    assert ours.config.ffn == ("gelu_tanh" if activation == "gelu_new" else "gelu")
    assert ours.config.tie_embeddings is tie and ours.config.bias and ours.config.norm_eps == 1e-5
    assert ours.num_parameters() == hf.num_parameters()
    assert_same_model(hf, ours)


@pytest.mark.parametrize("tie,scaling,kv_heads", [(False, None, 2), (True, None, 1), (False, LLAMA3, 2),
                                                  (True, LLAMA3, 4)])
def test_llama_logits_and_greedy_tokens_match(tie, scaling, kv_heads):
    hf = llama(tie, scaling, kv_heads)
    ours = from_hf(hf.state_dict(), hf.config.to_dict())
    assert ours.config.n_kv_heads == kv_heads and ours.config.tie_embeddings is tie
    assert ours.config.rope_scaling == (None if scaling is None else check_rope_scaling(scaling))
    assert ours.num_parameters() == hf.num_parameters()
    assert_same_model(hf, ours)


def test_llama_with_biases():
    hf = llama(bias=True)
    assert_same_model(hf, from_hf(hf.state_dict(), hf.config.to_dict()))


def test_llama3_scaling_changes_the_model():
    """The scaled model differs from the unscaled one with the same weights: the scaling is not a no-op."""
    hf = llama(scaling=LLAMA3)
    plain = hf.config.to_dict()
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    x = ids()
    scaled_logits = from_hf(hf.state_dict(), hf.config.to_dict())(x)[0]
    plain_logits = from_hf(hf.state_dict(), plain)(x)[0]
    assert (scaled_logits - plain_logits).abs().max() > 1e-3


def test_checkpoint_style_rope_keys_read_like_rope_parameters():
    """config.json files of Llama 3 checkpoints carry rope_theta and rope_scaling; recent transformers
    write rope_parameters. Both give the same model."""
    hf = llama(scaling=LLAMA3)
    new = hf.config.to_dict()
    old = copy.deepcopy(new)
    params = old.pop("rope_parameters")
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = params
    assert hf_config_to_gpt_config(old) == hf_config_to_gpt_config(new)
    old["rope_scaling"] = None  # a Llama 2 style config.json: plain RoPE
    assert hf_config_to_gpt_config(old).rope_scaling is None


def test_load_through_save_pretrained_folder(tmp_path):
    """The way a downloaded checkpoint arrives: config.json and model.safetensors in a folder (the
    saved GPT-2 file stores the tied head once, without lm_head.weight)."""
    for i, hf in enumerate([gpt2(), llama(scaling=LLAMA3), llama(tie=True)]):
        folder = tmp_path / str(i)
        hf.save_pretrained(folder, safe_serialization=True)
        assert (folder / "model.safetensors").is_file()
        assert_same_model(hf, from_hf_folder(folder))


def test_hub_style_gpt2_keys_with_mask_buffers():
    """GPT-2 as published: no 'transformer.' prefix, no lm_head, a causal-mask buffer per layer."""
    hf = gpt2()
    sd = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    n = hf.config.n_positions
    for i in range(hf.config.n_layer):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    assert_same_model(hf, from_hf(sd, hf.config.to_dict()))
    sd["h.0.attn.bias"] = torch.ones(1, 1, n, n)
    with pytest.raises(ValueError, match=r"state_dict\['h\.0\.attn\.bias'\] is not the causal mask"):
        from_hf(sd, hf.config.to_dict())


def test_dtype_argument():
    hf = llama()
    ours = from_hf(hf.state_dict(), hf.config.to_dict(), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    with pytest.raises(ValueError, match="dtype"):
        from_hf(hf.state_dict(), hf.config.to_dict(), dtype=torch.int64)


def test_llama3_inv_freq_matches_transformers():
    hf_config = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_theta=500000.0,
                            rope_scaling={**LLAMA3, "factor": 32.0, "original_max_position_embeddings": 64})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    scaling = {**LLAMA3, "factor": 32.0, "original_max_position_embeddings": 64}
    ours = rope_inv_freq(128, 500000.0, scaling).float()  # what every RotaryEmbedding uses
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    plain = 500000.0 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    scaled = llama3_inv_freq(plain, 32.0, 1.0, 8.0, 64)
    ratio = plain / scaled
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(32.0)  # fast kept, slow divided by factor
    assert ((ratio > 1) & (ratio < 32)).any()  # and a blended band in between


def gpt2_parts():
    hf = gpt2()
    return dict(hf.state_dict()), hf.config.to_dict()


def llama_parts(**kwargs):
    hf = llama(**kwargs)
    return dict(hf.state_dict()), hf.config.to_dict()


def test_bad_model_type_and_types():
    sd, cfg = gpt2_parts()
    with pytest.raises(ValueError, match=r"model_type.*'bert'"):
        from_hf(sd, {**cfg, "model_type": "bert"})
    with pytest.raises(TypeError, match="hf_config must be a dict"):
        from_hf(sd, GPT2Config())
    with pytest.raises(TypeError, match="state_dict must be a dict"):
        from_hf(list(sd.items()), cfg)
    with pytest.raises(ValueError, match=r"state_dict\['transformer.wte.weight'\] is a list, but model's"):
        from_hf({**sd, "transformer.wte.weight": [[0.0]]}, cfg)


def test_missing_extra_and_misshapen_tensors_are_named():
    sd, cfg = gpt2_parts()
    missing = {k: v for k, v in sd.items() if k != "transformer.h.1.mlp.c_fc.bias"}
    with pytest.raises(ValueError, match=r"no tensor 'transformer.h.1.mlp.c_fc.bias'"):
        from_hf(missing, cfg)
    with pytest.raises(ValueError, match=r"transformer.h.2.attn.c_attn.weight"):
        from_hf({**sd, "transformer.h.2.attn.c_attn.weight": torch.zeros(32, 96)}, cfg)
    with pytest.raises(ValueError, match=r"'transformer.h.0.attn.c_attn.weight'\] is a float32 tensor of shape \(96, 32\), but model's blocks.0.attn.q_proj.weight is a float32 tensor of shape \(32, 32\)"):
        from_hf({**sd, "transformer.h.0.attn.c_attn.weight": sd["transformer.h.0.attn.c_attn.weight"].t()}, cfg)
    with pytest.raises(ValueError, match=r"'transformer.wte.weight'\] is a float32 tensor of shape \(97, 32\), but model's tok_emb.weight is a float32 tensor of shape \(98, 32\)"):
        from_hf(sd, {**cfg, "vocab_size": 98})
    sd, cfg = llama_parts()
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.weight.*\(32, 64\).*\(16, 64\)"):
        from_hf(sd, {**cfg, "num_key_value_heads": 1})
    with pytest.raises(ValueError, match="no tensor 'lm_head.weight'"):
        from_hf({k: v for k, v in sd.items() if k != "lm_head.weight"}, cfg)
    with pytest.raises(ValueError, match=r"lm_head.weight != model.embed_tokens.weight"):
        from_hf(sd, {**cfg, "tie_word_embeddings": True})
    with pytest.raises(ValueError, match=r"no place for: 'model.layers.0.self_attn.q_proj.bias'"):
        from_hf({**sd, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, cfg)
    stale = {**sd, "model.rotary_emb.inv_freq": rope_inv_freq(16, 500000.0).float()}
    with pytest.raises(ValueError, match=r"model.rotary_emb.inv_freq'\] is not the RoPE frequencies"):
        from_hf(stale, cfg)
    from_hf({**sd, "model.rotary_emb.inv_freq": rope_inv_freq(16, 10000.0).float()}, cfg)


@pytest.mark.parametrize("change,match", [
    ({"activation_function": "swish"}, "activation_function"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"scale_attn_weights": False}, "scale_attn_weights"),
    ({"add_cross_attention": True}, "add_cross_attention"),
    ({"n_embd": None}, "no 'n_embd' field"),
    ({"n_head": 5}, "d_model"),
])
def test_gpt2_config_fields_lib_cannot_reproduce(change, match):
    sd, cfg = gpt2_parts()
    with pytest.raises(ValueError, match=match):
        from_hf(sd, {**cfg, **change})


@pytest.mark.parametrize("change,match", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "attention_bias=False but mlp_bias=True"),
    ({"head_dim": 32}, "head_dim"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
     r"\['rope_type'\] must be one of \('default', 'llama3'\), got 'yarn'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"rope_parameters": {**LLAMA3, "factor": 0.5, "rope_theta": 1e4}}, "factor"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "missing"),
    ({"num_key_value_heads": 3}, "n_kv_heads"),
])
def test_llama_config_fields_lib_cannot_reproduce(change, match):
    sd, cfg = llama_parts()
    with pytest.raises(ValueError, match=match):
        from_hf(sd, {**cfg, **change})


def test_read_hf_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="neither model.safetensors"):
        read_hf_folder(tmp_path)


def test_gpt_config_new_fields():
    base = GPTConfig.tiny(positions="rope")
    assert base.norm_eps is None and base.rope_scaling is None
    assert GPTConfig.tiny(norm_eps=1e-6).norm_eps == 1e-6
    with pytest.raises(ValueError, match="norm_eps"):
        GPTConfig.tiny(norm_eps=0.0)
    with pytest.raises(ValueError, match="rope_scaling needs positions='rope'"):
        GPTConfig.tiny(rope_scaling=LLAMA3)
    config = GPTConfig.tiny(positions="rope", rope_scaling=LLAMA3)
    assert GPTConfig.from_dict(config.to_dict()) == config
    with pytest.raises(TypeError, match="rope_scaling must be None or a dict"):
        check_rope_scaling([("rope_type", "llama3")])
    with pytest.raises(ValueError, match=r"rope_scaling\['rope_type'\]"):
        check_rope_scaling({**LLAMA3, "rope_type": "dynamic"})
    with pytest.raises(ValueError, match=r"unknown \['extra'\]"):
        check_rope_scaling({**LLAMA3, "extra": 1})
    with pytest.raises(ValueError, match="high_freq_factor"):
        check_rope_scaling({**LLAMA3, "high_freq_factor": 1.0})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        check_rope_scaling({**LLAMA3, "original_max_position_embeddings": 16.5})
    with pytest.raises(ValueError, match="low_freq_factor"):
        check_rope_scaling({**LLAMA3, "low_freq_factor": float("nan")})


def test_bad_values_where_data_enters_are_named(tmp_path):
    """from_hf checks its input where it enters: tensor names and types, weight dtypes,
    config field types, and the files of a checkpoint folder."""
    sd, cfg = gpt2_parts()
    with pytest.raises(ValueError, match="the model has no place for: 3"):
        from_hf({**sd, 3: torch.zeros(1)}, cfg)
    bad = {**sd, "transformer.wpe.weight": sd["transformer.wpe.weight"].long()}
    with pytest.raises(ValueError, match=r"'transformer.wpe.weight'\] is a int64 tensor of shape "
                                         r"\(48, 32\), but model's pos_emb.embedding.weight is a float32"):
        from_hf(bad, cfg)
    with pytest.raises(ValueError, match=r"hf_config does not describe.*d_model"):
        from_hf(sd, {**cfg, "n_embd": "32"})
    with pytest.raises(ValueError, match=r"hf_config does not describe.*tie_embeddings"):
        from_hf(sd, {**cfg, "tie_word_embeddings": "yes"})
    with pytest.raises(ValueError, match=r"hf_config does not describe.*norm_eps"):
        from_hf(sd, {**cfg, "layer_norm_epsilon": -1.0})
    hf = llama()
    checkpoint_style = {k: v for k, v in hf.config.to_dict().items() if k != "rope_parameters"}
    with pytest.raises(ValueError, match=r"hf_config\['rope_scaling'\] must be a dict"):
        from_hf(hf.state_dict(), {**checkpoint_style, "rope_scaling": "llama3"})
    with pytest.raises(TypeError, match="folder must be a str or pathlib.Path"):
        read_hf_folder(3)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="Expecting property name"):  # json's own error
        read_hf_folder(tmp_path)


def test_integer_config_numbers_are_read_as_floats():
    """config.json files write 500000 for rope_theta; lib's config holds the float."""
    hf = llama()
    cfg = {k: v for k, v in hf.config.to_dict().items() if k != "rope_parameters"}
    cfg.update(rope_theta=10000, rms_norm_eps=1)
    config = hf_config_to_gpt_config(cfg)
    assert isinstance(config.rope_base, float) and config.rope_base == 10000.0
    assert isinstance(config.norm_eps, float)
