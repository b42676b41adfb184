"""lib.training: the loop learns, resumes bit for bit, checkpoints safely, and rejects bad input."""
import dataclasses
import json
import math
import os

import pytest
import torch
from torch import nn

from lib.model import GPT, GPTConfig
from lib.checkpoint import best_checkpoint_path, load_checkpoint, save_checkpoint
from lib.training import History, TrainConfig, configure_optimizer, evaluate, lr_at, train

VOCAB = 12


@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: one thread is as fast as two and immune to other jobs on the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_gpt(seed: int = 0, dropout: float = 0.0, **overrides) -> GPT:
    """A GPT small enough to train in seconds on a CPU."""
    config = dataclasses.replace(GPTConfig.tiny(vocab_size=VOCAB), context_length=16, d_model=32, n_layers=2,
                                 n_heads=4, n_kv_heads=4, d_ff=64, dropout=dropout)
    config = dataclasses.replace(config, **overrides)
    torch.manual_seed(seed)
    return GPT(config)


def repeated(n_repeats: int = 40) -> torch.Tensor:
    """A short pattern over and over: every next token is determined by the ones before it."""
    pattern = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 11])
    return pattern.repeat(n_repeats)


def quick_config(**overrides) -> TrainConfig:
    values = dict(max_steps=30, batch_size=4, context_length=16, lr=3e-3, min_lr=3e-4, warmup_steps=5,
                  eval_interval=10, eval_batches=2, seed=1)
    values.update(overrides)
    return TrainConfig(**values)


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------- learning


def test_loss_on_a_repeated_sequence_falls_below_0_1():
    data = repeated()
    config = quick_config(max_steps=150, batch_size=8, lr=1e-2, min_lr=1e-3, warmup_steps=20,
                          eval_interval=50, weight_decay=0.0)
    history = train(small_gpt(), data, data, config, progress=False)
    assert history.step == [0, 50, 100, 150]
    assert history.train_loss[0] > 2.0  # starts near ln(12) ≈ 2.48
    assert history.train_loss[-1] < 0.1 and history.val_loss[-1] < 0.1
    assert len(history.batch_loss) == len(history.grad_norm) == 150
    assert history.lr == [lr_at(s, config) for s in history.step]


def test_training_is_deterministic_for_a_seed_and_depends_on_it():
    data = repeated()
    first = train(small_gpt(), data, data, quick_config(), progress=False)
    second = train(small_gpt(), data, data, quick_config(), progress=False)
    other_seed = train(small_gpt(), data, data, quick_config(seed=2), progress=False)
    assert first.as_dict() == second.as_dict()
    assert first.batch_loss != other_seed.batch_loss


# ---------------------------------------------------------------- resume


def test_resume_continues_bit_for_bit(tmp_path):
    """A run split in two sessions (with dropout, so the global RNG matters) equals an unbroken one."""
    data = repeated()
    config = quick_config(max_steps=40, eval_interval=15)
    whole_model = small_gpt(dropout=0.1)
    whole = train(whole_model, data, data, config, progress=False)

    path = tmp_path / "run.safetensors"
    train(small_gpt(dropout=0.1), data, data, config, checkpoint_path=path, progress=False, stop_at=22)
    torch.manual_seed(12345)  # a different global RNG state and fresh weights: all must come from the file
    resumed_model = small_gpt(seed=7, dropout=0.1)
    resumed = train(resumed_model, data, data, config, checkpoint_path=path, resume=True, progress=False)

    assert resumed.as_dict() == whole.as_dict()
    assert same_weights(resumed_model, whole_model)
    # the latest and the best checkpoint, no temporary files left behind
    assert sorted(tmp_path.iterdir()) == sorted([path, best_checkpoint_path(path)])


@pytest.mark.parametrize("crash_at_step, last_checkpoint", [(1, 0), (25, 20)])
def test_resume_after_a_crash_replays_from_the_last_checkpoint(tmp_path, crash_at_step, last_checkpoint):
    data = repeated()
    config = quick_config(max_steps=30, eval_interval=10)
    whole = train(small_gpt(), data, data, config, progress=False)

    class Crash(RuntimeError):
        pass

    model = small_gpt()
    calls = {"n": 0}
    original_forward = model.forward

    def crashing_forward(*args, **kwargs):
        calls["n"] += model.training  # evaluation runs in eval mode and is not counted
        if calls["n"] == crash_at_step:
            raise Crash("power cut")
        return original_forward(*args, **kwargs)

    model.forward = crashing_forward
    path = tmp_path / "run.safetensors"
    with pytest.raises(Crash):
        train(model, data, data, config, checkpoint_path=path, progress=False)
    assert load_checkpoint(path, small_gpt()).step == last_checkpoint  # later steps died with the crash
    resumed = train(small_gpt(seed=3), data, data, config, checkpoint_path=path, resume=True, progress=False)
    assert resumed.as_dict() == whole.as_dict()


def test_the_best_checkpoint_holds_the_weights_of_the_lowest_validation_loss(tmp_path):
    """Validation text that is 30% the training pattern and 70% its characters shuffled: the loss
    falls while the model learns which characters occur, then rises as it memorises the pattern.
    The latest checkpoint holds the overfit end, the best one the weights of the lowest loss."""
    data = repeated()
    shuffled = data[torch.randperm(len(data), generator=torch.Generator().manual_seed(0))]
    val = torch.cat([data[: len(data) * 3 // 10], shuffled[: len(data) * 7 // 10]])
    config = quick_config(max_steps=60, eval_interval=5, lr=1e-2, min_lr=1e-3)
    path = tmp_path / "run.safetensors"
    history = train(small_gpt(), data, val, config, checkpoint_path=path, progress=False)
    best = min(range(len(history.step)), key=history.val_loss.__getitem__)
    assert 0 < best < len(history.step) - 1  # the lowest loss lies inside the run
    assert history.val_loss[-1] > history.val_loss[best] + 0.5  # and the end is overfit
    model = small_gpt(seed=9)
    assert load_checkpoint(path, model).step == config.max_steps
    assert load_checkpoint(best_checkpoint_path(path), model).step == history.step[best]
    again = evaluate(model, val, batch_size=config.batch_size, context_length=config.context_length,
                     n_batches=config.eval_batches, seed=config.seed + 2)
    assert again == history.val_loss[best]
    without_val = tmp_path / "no_val.safetensors"
    train(small_gpt(), data, None, config, checkpoint_path=without_val, progress=False)
    assert not best_checkpoint_path(without_val).exists()  # no validation loss, no best


def test_lr_schedule_equals_torchs_linear_warmup_then_cosine_annealing():
    """lr_at over a whole run against torch's own schedulers: LinearLR for the warmup, then
    CosineAnnealingLR down to min_lr, chained by SequentialLR."""
    config = TrainConfig(max_steps=300, lr=3e-3, min_lr=3e-4, warmup_steps=40)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=config.lr)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / config.warmup_steps,
                                               end_factor=1.0, total_iters=config.warmup_steps - 1)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=config.max_steps - config.warmup_steps, eta_min=config.min_lr)
    schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine],
                                                     milestones=[config.warmup_steps])
    theirs = []
    for _ in range(config.max_steps):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    ours = [lr_at(step, config) for step in range(config.max_steps)]
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64),
                               torch.tensor(theirs, dtype=torch.float64), rtol=1e-9, atol=1e-12)


def test_resume_with_different_settings_names_them(tmp_path):
    data = repeated()
    path = tmp_path / "run.safetensors"
    train(small_gpt(), data, data, quick_config(), checkpoint_path=path, progress=False, stop_at=10)
    with pytest.raises(ValueError, match=r"lr: checkpoint 0.003, given 0.001"):
        train(small_gpt(), data, data, quick_config(lr=1e-3), checkpoint_path=path, resume=True,
              progress=False)
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        train(small_gpt(), data, data, quick_config(), checkpoint_path=tmp_path / "missing.safetensors",
              resume=True, progress=False)


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip_keeps_tied_weights_and_optimizer_state(tmp_path):
    model = small_gpt()
    assert model.lm_head.weight is model.tok_emb.weight  # the tiny preset ties them
    optimizer = configure_optimizer(model, 1e-3, 0.1)
    ids = repeated(2)
    _, loss = model(ids[None, :16], ids[None, 1:17])
    loss.backward()
    optimizer.step()
    history = History(step=[0], train_loss=[1.0], val_loss=[float("nan")], lr=[1e-3], batch_loss=[2.0],
                      grad_norm=[0.5])
    path = save_checkpoint(tmp_path / "ck.safetensors", model, optimizer, step=1, train_config=quick_config(),
                           history=history, extra={"note": "hello"})

    loaded = small_gpt(seed=5)
    loaded_optimizer = configure_optimizer(loaded, 1e-3, 0.1)
    checkpoint = load_checkpoint(path, loaded, loaded_optimizer)
    assert same_weights(loaded, model)
    assert loaded.lm_head.weight is loaded.tok_emb.weight
    assert checkpoint.step == 1 and checkpoint.extra == {"note": "hello"}
    assert checkpoint.train_config == quick_config()
    assert checkpoint.model_config == json.loads(json.dumps(dataclasses.asdict(model.config)))
    assert checkpoint.history.step == [0] and math.isnan(checkpoint.history.val_loss[0])
    saved, restored = optimizer.state_dict(), loaded_optimizer.state_dict()
    assert saved["param_groups"] == restored["param_groups"]
    for index, slots in saved["state"].items():
        for key, value in slots.items():
            assert torch.equal(value, restored["state"][index][key]), (index, key)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    """A failure while writing leaves the previous checkpoint intact and no temporary file."""
    import safetensors.torch

    path = tmp_path / "ck.safetensors"
    model = small_gpt()
    save_checkpoint(path, model, step=3)
    before = path.read_bytes()

    def broken(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, small_gpt(seed=1), step=4)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ck.safetensors"]


def test_checkpoint_of_another_config_is_rejected_naming_the_fields(tmp_path):
    path = save_checkpoint(tmp_path / "ck.safetensors", small_gpt())
    with pytest.raises(ValueError, match=r"model config does not match.*n_layers: checkpoint 2, given 3"):
        load_checkpoint(path, small_gpt(n_layers=3))
    with pytest.raises(ValueError, match=r"d_model: checkpoint 32, given 48"):
        load_checkpoint(path, small_gpt(d_model=48))
    with pytest.raises(ValueError, match="tensors do not fit model"):
        load_checkpoint(path, nn.Linear(3, 4))
    not_a_checkpoint = tmp_path / "junk.safetensors"
    not_a_checkpoint.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        load_checkpoint(not_a_checkpoint, small_gpt())
    with pytest.raises(FileNotFoundError, match="nope"):
        load_checkpoint(tmp_path / "nope.safetensors", small_gpt())


# ---------------------------------------------------------------- pieces


def test_lr_schedule_warms_up_linearly_then_follows_a_cosine():
    config = TrainConfig(max_steps=110, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, config) == pytest.approx(0.1)
    assert lr_at(4, config) == pytest.approx(0.5)
    assert lr_at(9, config) == pytest.approx(1.0)
    assert lr_at(10, config) == pytest.approx(1.0)
    assert lr_at(60, config) == pytest.approx(0.55)  # halfway through the decay: the mean of lr and min_lr
    assert lr_at(110, config) == pytest.approx(0.1) and lr_at(500, config) == pytest.approx(0.1)
    decay = [lr_at(s, config) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert lr_at(0, TrainConfig(max_steps=5, lr=1.0, min_lr=1.0, warmup_steps=0)) == 1.0


def test_weight_decay_applies_to_matrices_only_and_tied_weights_once():
    model = small_gpt(bias=True)
    optimizer = configure_optimizer(model, lr=1e-3, weight_decay=0.1)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(no_decay["params"]) > 0  # norm gains and biases
    ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == model.num_parameters()


def test_evaluate_is_repeatable_and_restores_the_mode():
    model = small_gpt(dropout=0.2)
    data = repeated()
    model.train()
    first = evaluate(model, data, batch_size=4, context_length=16, n_batches=3, seed=5)
    second = evaluate(model, data, batch_size=4, context_length=16, n_batches=3, seed=5)
    assert first == second and model.training
    assert math.log(VOCAB) - 1.0 < first < math.log(VOCAB) + 1.0  # an untrained model is near-uniform


def test_history_round_trips_through_a_dict():
    history = History(step=[0, 5], train_loss=[2.0, 1.0], val_loss=[2.1, 1.2], lr=[0.1, 0.2],
                      batch_loss=[1.5] * 5, grad_norm=[0.3] * 5)
    assert History.from_dict(history.as_dict()) == history
    with pytest.raises(ValueError, match="values"):
        History.from_dict({"step": []})


def test_non_finite_loss_stops_with_a_clear_error():
    class Exploding(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2, 2))

        def forward(self, x, y):
            return None, self.w.sum() * float("nan")

    with pytest.raises(FloatingPointError, match="lower config.lr"):
        train(Exploding(), repeated(), None, quick_config(), progress=False)


def nan_at(model: nn.Module, bad_step: int) -> nn.Module:
    """``model`` whose training loss is NaN at training step ``bad_step`` (1-based) and after."""
    original_forward, calls = model.forward, {"n": 0}

    def forward(x, y):
        logits, loss = original_forward(x, y)
        calls["n"] += model.training  # evaluation runs in eval mode and is not counted
        return logits, loss * float("nan") if calls["n"] >= bad_step else loss

    model.forward = forward
    return model


def test_on_a_cpu_a_non_finite_loss_stops_the_run_at_its_step_before_its_update(tmp_path):
    """Step 7's loss is NaN: the error names step 7 and the weights are those after step 6
    (the run of a model that stops there), so neither step 7 nor any later one changed them."""
    data, config = repeated(), quick_config(max_steps=30, eval_interval=10)
    path = tmp_path / "run.safetensors"
    model = nan_at(small_gpt(), bad_step=7)
    with pytest.raises(FloatingPointError, match=r"became nan at step 7 \(.*batch_loss\[6\]\)"):
        train(model, data, data, config, checkpoint_path=path, progress=False)
    six_steps = small_gpt()
    train(six_steps, data, data, config, progress=False, stop_at=6)
    assert same_weights(model, six_steps)
    assert load_checkpoint(path, small_gpt()).step == 0  # nothing saved after the NaN


@pytest.mark.parametrize("bad_step, stop_at", [(7, None), (23, None), (13, 15)])
def test_where_reading_each_loss_would_wait_for_a_gpu_the_first_bad_step_is_named_later(
        tmp_path, monkeypatch, bad_step, stop_at):
    """The deferred check (a GPU's, or several processes'), forced on the CPU by a stand-in
    for two processes (rank 0 of 2, each of which trains on half the batch and agrees with the
    other): the losses are read at the next evaluation (steps 10, 20, 30), or at the end of a
    session that stops between evaluations; the error names the first bad step, and nothing is
    saved after it."""
    from lib import distributed

    monkeypatch.setattr(distributed, "rank_and_size", lambda: (0, 2))
    monkeypatch.setattr(distributed, "wrap", lambda model, device: model)
    monkeypatch.setattr(distributed, "mean_over_processes", lambda values: values)
    monkeypatch.setattr(distributed, "barrier", lambda: None)
    data, config = repeated(), quick_config(max_steps=30, eval_interval=10)
    path = tmp_path / "run.safetensors"
    model = nan_at(small_gpt(), bad_step)
    with pytest.raises(FloatingPointError, match=rf"became nan at step {bad_step} "):
        train(model, data, data, config, checkpoint_path=path, progress=False, stop_at=stop_at)
    assert load_checkpoint(path, small_gpt()).step == (bad_step - 1) // 10 * 10


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("field, value", [
    ("max_steps", 0), ("max_steps", 2.5), ("batch_size", -1), ("context_length", True), ("lr", 0.0),
    ("lr", float("nan")), ("min_lr", -1e-3), ("warmup_steps", -1), ("weight_decay", -0.1),
    ("grad_clip", 0.0), ("eval_interval", 0), ("eval_batches", 0), ("seed", -3), ("device", "tpu"),
    ("betas", (0.9, 1.0)), ("betas", (0.9,)), ("amp", "yes"), ("compile", 1),
])
def test_train_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: value})


def test_train_config_cross_field_checks():
    with pytest.raises(ValueError, match="min_lr must be <= lr"):
        TrainConfig(lr=1e-3, min_lr=1e-2)
    with pytest.raises(ValueError, match="warmup_steps must be <= max_steps"):
        TrainConfig(max_steps=10, warmup_steps=11)
    assert TrainConfig.from_dict(TrainConfig().to_dict()) == TrainConfig()
    with pytest.raises(ValueError, match="unknown TrainConfig fields"):
        TrainConfig.from_dict({"learning_rate": 1.0})


def test_train_rejects_bad_arguments_naming_them():
    model, data, config = small_gpt(), repeated(), quick_config()
    cases = [
        (dict(train_data=data[None, :]), ValueError, "train_data must be a 1-D tensor of token ids"),
        (dict(train_data=data.float()), TypeError, "train_data must be an integer tensor"),
        (dict(train_data=data[:10]), ValueError, "train_data has 10 tokens"),
        (dict(val_data=data + VOCAB), ValueError, r"val_data holds token id \d+, out of range \[0, vocab_size=12\)"),
        (dict(config=quick_config(context_length=17)), ValueError, "exceeds the model's context_length=16"),
        (dict(config={"max_steps": 3}), TypeError, "config must be a TrainConfig"),
        (dict(model="gpt"), TypeError, "model must be a torch.nn.Module"),
        (dict(resume=True), ValueError, "resume=True needs a checkpoint_path"),
        (dict(stop_at=31), ValueError, r"stop_at must be None or an int in \[1, 30\]"),
        (dict(checkpoint_path=3), TypeError, "checkpoint_path must be"),
        (dict(progress="no"), ValueError, "progress must be True or False"),
    ]
    for change, error, message in cases:
        kwargs = dict(model=model, train_data=data, val_data=data, config=config, progress=False)
        kwargs.update(change)
        with pytest.raises(error, match=message):
            train(**kwargs)


def test_a_model_that_does_not_return_logits_and_loss_is_a_type_error():
    class LogitsOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, VOCAB)

        def forward(self, x, y):
            return self.emb(x)

    with pytest.raises(TypeError, match=r"must return \(logits, loss\)"):
        train(LogitsOnly(), repeated(), None, quick_config(), progress=False)


def test_other_helpers_reject_bad_arguments():
    model = small_gpt()
    with pytest.raises(ValueError, match="weight_decay must be"):
        configure_optimizer(model, 1e-3, -0.5)
    with pytest.raises(ValueError, match="lr must be"):
        configure_optimizer(model, 0.0, 0.1)
    with pytest.raises(ValueError, match="n_batches must be a positive int"):
        evaluate(model, repeated(), 4, 16, n_batches=0)
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        save_checkpoint("x.safetensors", model, step=-1)
    with pytest.raises(TypeError, match="not JSON serializable"):  # json's own error
        save_checkpoint("x.safetensors", model, extra={"tensor": torch.ones(1)})
    with pytest.raises(TypeError, match="optimizer must be"):
        load_checkpoint("x.safetensors", model, optimizer="adam")


def test_progress_bar_can_be_switched_off(capsys):
    data = repeated()
    train(small_gpt(), data, data, quick_config(max_steps=5, warmup_steps=1), progress=False)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    train(small_gpt(), data, data, quick_config(max_steps=5, warmup_steps=1), progress=True)
    assert "training" in capsys.readouterr().err
