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
