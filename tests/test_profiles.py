"""lib.profiles: the CPU and GPU training profiles are valid, consistent configs."""
from __future__ import annotations

import pytest
import torch

from lib.model import GPT
from lib.profiles import Profile, cpu_profile, gpu_profile
from lib.training import train


@pytest.mark.parametrize("make", [cpu_profile, gpu_profile])
def test_profiles_are_consistent(make):
    profile = make(65, max_steps=500)
    assert isinstance(profile, Profile)
    assert profile.train.max_steps == 500
    assert profile.train.context_length <= profile.model.context_length
    assert profile.model.vocab_size == 65


def test_gpu_profile_asks_for_the_cuda_speed_ups():
    train_config = gpu_profile().train
    assert train_config.amp and train_config.compile


def test_cpu_profile_trains_a_few_steps():
    profile = cpu_profile(11, max_steps=50)
    data = torch.arange(2000) % 11
    config = profile.train.__class__(**{**profile.train.to_dict(), "max_steps": 3, "warmup_steps": 1,
                                        "eval_interval": 3, "eval_batches": 1, "batch_size": 2,
                                        "betas": tuple(profile.train.betas)})
    history = train(GPT(profile.model), data, data, config, progress=False)
    assert len(history.batch_loss) == 3


@pytest.mark.parametrize("make", [cpu_profile, gpu_profile])
@pytest.mark.parametrize("kwargs, name", [(dict(vocab_size=0), "vocab_size"),
                                          (dict(vocab_size="65"), "vocab_size"),
                                          (dict(max_steps=10), "max_steps")])
def test_profiles_reject_bad_arguments(make, kwargs, name):
    with pytest.raises((ValueError, TypeError), match=name):
        make(**kwargs)


def test_gpu_profile_training_settings_run_on_the_cpu_where_amp_and_compile_are_ignored():
    profile = gpu_profile(11, max_steps=200)
    small_model = profile.model.__class__(**{**profile.model.to_dict(), "d_model": 24, "n_heads": 2,
                                             "n_layers": 1, "d_ff": 48, "context_length": 16})
    values = {**profile.train.to_dict(), "max_steps": 2, "warmup_steps": 1, "eval_interval": 2,
              "eval_batches": 1, "batch_size": 2, "context_length": 16}
    config = profile.train.__class__.from_dict(values)
    assert config.amp and config.compile
    data = torch.arange(500) % 11
    history = train(GPT(small_model), data, None, config, progress=False)
    assert len(history.batch_loss) == 2 and all(torch.isfinite(torch.tensor(history.batch_loss)))
