"""lib.checkpoint: a checkpoint round-trips the whole GPTConfig (every field, including the
ones that change what runs without adding parameters) and the weights bit for bit; older
files lacking a newer config field load with its default; bad files and models are named.
(Training resumes bit for bit: tests/test_training.py.)"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lib.checkpoint import load_checkpoint, save_checkpoint
from lib.config import GPTConfig
from lib.model import GPT

LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
          "original_max_position_embeddings": 16}


def unusual_config(**overrides) -> GPTConfig:
    """A config far from every default, so a field that is not saved or not compared shows."""
    settings = dict(vocab_size=50, context_length=32, d_model=32, n_layers=2, n_heads=4,
                    n_kv_heads=2, d_ff=48, norm="rmsnorm", ffn="swiglu", positions="rope",
                    rope_base=5000.0, tie_embeddings=False, bias=True, window=8, sinks=2,
                    norm_eps=1e-5, rope_scaling=dict(LLAMA3), qk_norm=True, dropout=0.1)
    return GPTConfig(**{**settings, **overrides})


# The fields unusual_config cannot set together with the others: cpu_kernels (no window) and the
# mixture of experts.
CONFIGS = {"window+sinks": {}, "cpu_kernels": dict(window=None, sinks=0, cpu_kernels=True),
           "moe": dict(ffn="moe", n_experts=4, moe_top_k=2, moe_aux_weight=0.05)}


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_gpt_config_and_weights_round_trip(tmp_path, overrides):
    torch.manual_seed(0)
    model = GPT(unusual_config(**overrides)).eval()
    path = save_checkpoint(tmp_path / "ck.safetensors", model, step=7)
    checkpoint = load_checkpoint(path, GPT(unusual_config(**overrides)))
    rebuilt = GPT(GPTConfig.from_dict(checkpoint.model_config)).eval()
    assert rebuilt.config == model.config and checkpoint.step == 7
    load_checkpoint(path, rebuilt)
    for (name, ours), theirs in zip(rebuilt.state_dict().items(), model.state_dict().values()):
        assert torch.equal(ours, theirs), name
    ids = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(1))
    assert torch.equal(rebuilt(ids)[0], model(ids)[0])


def test_cpu_kernels_need_not_match(tmp_path):
    """cpu_kernels changes how attention is computed on a CPU, not what: a checkpoint of a
    cpu_kernels model loads into the same model without them, and back."""
    torch.manual_seed(0)
    config = unusual_config(**CONFIGS["cpu_kernels"])
    path = save_checkpoint(tmp_path / "ck.safetensors", GPT(config))
    plain = GPT(dataclasses.replace(config, cpu_kernels=False))
    load_checkpoint(path, plain)
    load_checkpoint(save_checkpoint(tmp_path / "plain.safetensors", plain), GPT(config))


def test_a_field_that_adds_no_parameters_still_has_to_match(tmp_path):
    path = save_checkpoint(tmp_path / "ck.safetensors", GPT(unusual_config()))
    with pytest.raises(ValueError, match=r"model config does not match model: window: checkpoint 8, "
                                         r"given 16"):
        load_checkpoint(path, GPT(unusual_config(window=16)))


def test_an_older_file_without_a_newer_field_loads_with_its_default(tmp_path):
    """A file written before a config field existed (here: qk_norm, removed from the header) loads
    into a model with that field at its default, and is refused for any other value."""
    config = dataclasses.replace(unusual_config(), qk_norm=False)
    torch.manual_seed(0)
    model = GPT(config)
    path = save_checkpoint(tmp_path / "ck.safetensors", model)
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    header = json.loads(metadata["gptbook"])
    del header["model_config"]["qk_norm"]
    old = tmp_path / "old.safetensors"
    save_file(load_file(str(path)), str(old), metadata={**metadata, "gptbook": json.dumps(header)})
    checkpoint = load_checkpoint(old, GPT(config))
    assert GPTConfig.from_dict(checkpoint.model_config) == config
    with pytest.raises(ValueError, match="qk_norm: checkpoint False, given True"):
        load_checkpoint(old, GPT(dataclasses.replace(config, qk_norm=True)))


def test_bad_files_and_models_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        load_checkpoint(tmp_path / "missing.safetensors", GPT(GPTConfig.tiny(n_layers=1)))
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable checkpoint written by save_checkpoint"):
        load_checkpoint(tmp_path / "junk.safetensors", GPT(GPTConfig.tiny(n_layers=1)))
    path = save_checkpoint(tmp_path / "ck.safetensors", torch.nn.Linear(3, 4))
    with pytest.raises(ValueError, match=r"the checkpoint's tensors do not fit model: the checkpoint"
                                         r"\['weight'\] is a float32 tensor of shape \(4, 3\), but "
                                         r"model's weight is a float32 tensor of shape \(5, 3\)"):
        load_checkpoint(path, torch.nn.Linear(3, 5))
    with pytest.raises(ValueError, match="holds no optimizer state"):
        model = torch.nn.Linear(3, 4)
        load_checkpoint(path, model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        save_checkpoint(path, "model")
