"""lib.tiny_model: the shared trained model is cached, loads identical to a fresh run, and races safely.

These tests train the real tiny preset for four steps on a few hundred characters (``text=TEXT``;
one test on TinyShakespeare itself), which is enough to check the caching logic in seconds.
"""
import dataclasses
import multiprocessing
import os
import warnings

import pytest
import torch

from lib import data, tiny_model
from lib.tiny_model import TINY_TRAIN_CONFIG, cache_key, tiny_shakespeare_model, tiny_shakespeare_run
from lib.model import GPTConfig
from lib.training import TrainConfig

SHORT = TrainConfig(max_steps=4, batch_size=2, context_length=32, lr=1e-3, min_lr=1e-4, warmup_steps=1,
                    eval_interval=2, eval_batches=1)
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n" * 8
VOCAB = len(set(TEXT))


def short_run(**kwargs) -> tiny_model.PretrainedRun:
    return tiny_shakespeare_run(train_config=SHORT, text=TEXT, **kwargs)


@pytest.fixture()
def empty_cache(tmp_path, monkeypatch):
    """An empty model cache; the corpus still comes from wherever it is found now."""
    monkeypatch.setenv("GPTBOOK_DATA", str(data.corpus_path().parent))
    monkeypatch.setenv("GPTBOOK_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is as fast and unaffected by other jobs
    yield tmp_path / "cache"
    torch.set_num_threads(threads)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_cached_model_is_identical_to_a_fresh_one_and_is_loaded_not_trained(empty_cache, monkeypatch):
    fresh = short_run()
    assert fresh.trained
    assert fresh.path.is_file() and fresh.path.parent.parent == empty_cache / "models"
    assert os.listdir(fresh.path.parent) == ["model.safetensors"]  # no temporary files left
    assert fresh.tokenizer.vocab_size == VOCAB and fresh.model.config == GPTConfig.tiny(VOCAB)
    assert not fresh.model.training
    assert fresh.history.step == [0, 2, 4]

    def no_training(*args, **kwargs):
        raise AssertionError("the cached model should have been loaded, not trained")

    monkeypatch.setattr(tiny_model, "train", no_training)
    cached = short_run()
    assert not cached.trained and cached.path == fresh.path
    assert same_weights(cached.model, fresh.model)
    assert cached.model.lm_head.weight is cached.model.tok_emb.weight  # still tied after loading
    assert cached.history == fresh.history
    model, tokenizer = tiny_shakespeare_model(train_config=SHORT, text=TEXT)
    assert same_weights(model, fresh.model) and tokenizer.chars == fresh.tokenizer.chars

    # A second, independent training run (another empty cache) gives the same weights, bit for bit.
    monkeypatch.undo()
    monkeypatch.setenv("GPTBOOK_DATA", str(data.corpus_path().parent))
    monkeypatch.setenv("GPTBOOK_CACHE", str(empty_cache.parent / "other"))
    again = short_run()
    assert again.trained and same_weights(again.model, fresh.model)


def test_the_callers_random_state_and_threads_are_the_same_whether_trained_or_loaded(empty_cache):
    torch.set_num_threads(2)  # training uses one thread, then gives the caller's setting back
    torch.manual_seed(42)
    short_run()  # trains
    after_training = torch.rand(4)
    assert torch.get_num_threads() == 2
    torch.manual_seed(42)
    short_run()  # loads
    after_loading = torch.rand(4)
    torch.manual_seed(42)
    assert torch.equal(after_training, torch.rand(4)) and torch.equal(after_loading, after_training)


def test_seed_and_config_change_the_key_and_the_model(empty_cache):
    run0, run1 = short_run(seed=0), short_run(seed=1)
    assert run0.path != run1.path and not same_weights(run0.model, run1.model)
    other_text = tiny_shakespeare_run(train_config=SHORT, text=TEXT.replace("speak", "Speak"))
    assert other_text.path != run0.path and other_text.trained
    config = GPTConfig.tiny(65)
    assert cache_key(config, SHORT, 0) == cache_key(config, SHORT, 0)
    assert cache_key(config, SHORT, 0) != cache_key(config, TINY_TRAIN_CONFIG, 0)
    assert cache_key(config, SHORT, 0) != cache_key(GPTConfig.tiny(65, n_layers=2), SHORT, 0)
    assert cache_key(config, SHORT, 0) != cache_key(config, SHORT, 0, corpus="0" * 64)


def test_the_default_text_is_tiny_shakespeare_keyed_by_its_checksum(empty_cache):
    run = tiny_shakespeare_run(train_config=SHORT)
    assert run.trained and run.tokenizer.vocab_size == 65
    config = dataclasses.replace(SHORT, seed=0, device=None)
    assert run.path.parent.name == cache_key(GPTConfig.tiny(65), config, 0,
                                             corpus=data.TINY_SHAKESPEARE.sha256)


def test_an_unreadable_cache_file_is_rebuilt(empty_cache):
    first = short_run()
    good = first.path.read_bytes()
    first.path.write_bytes(good[: len(good) // 2])  # truncated, as if a disk filled up
    with pytest.warns(UserWarning, match="unreadable cached model"):
        rebuilt = short_run()
    assert rebuilt.trained and same_weights(rebuilt.model, first.model)
    reloaded = short_run()
    assert not reloaded.trained and same_weights(reloaded.model, first.model)


def _fill_the_cache(start) -> None:
    """In a forked process: wait for the start signal, then train and cache the short run."""
    torch.set_num_threads(1)
    start.wait()
    short_run()


def test_two_processes_filling_the_cache_at_once_both_succeed(empty_cache):
    """Two processes forked from this one (no second import of torch) start training together and
    both write the same cache file; each must finish, and the file they leave must load."""
    context = multiprocessing.get_context("fork")
    start = context.Event()
    procs = [context.Process(target=_fill_the_cache, args=(start,)) for _ in range(2)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the file they left must load cleanly
        run = short_run()
    assert not run.trained
    assert os.listdir(run.path.parent) == ["model.safetensors"]
    os.environ["GPTBOOK_CACHE"] = str(empty_cache.parent / "in-process")  # restored by monkeypatch
    fresh = short_run()
    assert fresh.trained and same_weights(run.model, fresh.model)


def test_bad_arguments_are_named(empty_cache):
    with pytest.raises(ValueError, match="device must be"):
        tiny_shakespeare_run(device="tpu")
    with pytest.raises(TypeError, match="train_config must be a TrainConfig"):
        tiny_shakespeare_run(train_config={"max_steps": 3})
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        tiny_shakespeare_run(seed=-1)
    with pytest.raises(ValueError, match="num_threads must be None or a positive int"):
        tiny_shakespeare_run(num_threads=0)
    with pytest.raises(ValueError, match="progress must be True or False"):
        short_run(progress=1)  # checked by train

