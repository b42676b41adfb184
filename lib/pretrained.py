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
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from lib import data
from lib.model import GPT, GPTConfig
from lib.tokenizers import CharTokenizer
from lib.checkpoint import load_checkpoint, save_checkpoint
from lib.config import History, TrainConfig, _device_type
from lib.training import train

__all__ = ["TINY_TRAIN_CONFIG", "PretrainedRun", "tiny_shakespeare_model", "tiny_shakespeare_run", "cache_key"]

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
    one by default, because on a machine shared with other jobs a second thread can make each step
    several times slower instead of faster, and the weights then do not depend on how many cores the
    machine has. ``None`` keeps torch's setting (faster on an idle multi-core machine).
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
