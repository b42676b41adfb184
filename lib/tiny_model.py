"""The book's one trained model: the tiny character-level GPT on TinyShakespeare, trained
once and cached.

Chapters that need a model that has learned something (attention maps with structure,
sampling, a KV cache on real weights) call :func:`tiny_shakespeare_model`. The first call
trains the tiny preset (``GPTConfig.tiny``) with :func:`lib.training.train` for a fixed seed
and number of steps, which takes about two minutes on one CPU thread, and saves it; every
later call loads the file in a fraction of a second. Training runs inside
``torch.random.fork_rng``, so the caller's random state is the same whether the model was
trained or loaded, and a notebook prints the same samples either way.

The cache file lives in ``lib.data.cache_dir() / "models" / <key> / "model.safetensors"``.
The key hashes everything the weights depend on: model and training configs, seed, device
type, thread count, the torch version, the text's checksum and the source of the library
code the computation runs through (whole modules, and the few data and tokenizer functions
it uses). Change any of them and the model is trained afresh. The file is written
atomically (temporary name, then rename), so two processes racing to fill the cache both
end with a complete, identical file.
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
from lib.checkpoint import load_checkpoint, save_checkpoint
from lib.checks import check_int, check_type, torch_threads
from lib.config import History, TrainConfig, device_type
from lib.model import GPT, GPTConfig
from lib.tokenizers import CharTokenizer
from lib.training import train

__all__ = ["TINY_TRAIN_CONFIG", "PretrainedRun", "tiny_shakespeare_model",
           "tiny_shakespeare_run", "cache_key"]

# Tuned so the first call trains in about two minutes on one CPU thread (about 1.2M training
# tokens) while the model learns visibly: validation loss near 1.97 nats per character
# against 3.35 for the unigram baseline, past the ~2.5 plateau of a bigram-like model, with
# heads that attend with structure (e.g. a previous-token head in the first layer).
TINY_TRAIN_CONFIG = TrainConfig(
    max_steps=600, batch_size=16, context_length=128, lr=1e-2, min_lr=1e-3, warmup_steps=50,
    weight_decay=0.1, grad_clip=1.0, eval_interval=100, eval_batches=8, seed=0,
)

# Library modules whose code decides the trained weights; their source is part of the key.
_CODE = ("model", "config", "block", "attention", "feedforward", "norms", "positional", "loss",
         "checks", "training", "checkpoint")
# From the data and tokenizer modules the run uses only these (the corpus itself is keyed by
# its checksum), so an edit to, say, a download error message does not retrain the model.
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
    trained: bool  # True when this call trained the model, False when it loaded it


def _code_fingerprint() -> str:
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for name in _CODE:
        path = root / f"{name}.py"
        if path.exists():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    for obj in _CODE_OBJECTS:
        source = inspect.getsource(obj).encode()
        digest.update(obj.__qualname__.encode() + b"\0" + source + b"\0")
    return digest.hexdigest()


def cache_key(model_config: GPTConfig, train_config: TrainConfig, seed: int,
              device: str = "cpu", num_threads: int | None = 1,
              corpus: str = data.TINY_SHAKESPEARE.sha256) -> str:
    """The cache folder name for a run: a readable prefix plus a hash of everything the
    weights depend on (``corpus``: the SHA-256 of the text trained on)."""
    material = {
        "format": _FORMAT,
        "model_config": dataclasses.asdict(model_config),
        "train_config": train_config.to_dict(),
        "seed": seed,
        "device": torch.device(device).type,
        "num_threads": num_threads,
        "torch": torch.__version__,
        "corpus": corpus,
        "code": _code_fingerprint(),
    }
    text = json.dumps(material, sort_keys=True, default=str)
    return f"tiny-shakespeare-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _check_run_args(device: object, train_config: object, num_threads: object) -> str:
    """The arguments of :func:`tiny_shakespeare_run` that nothing after it checks (``seed``
    goes through ``TrainConfig``, ``progress`` through ``train``); returns the device string."""
    device = str(device) if isinstance(device, torch.device) else device
    if device_type(device) not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'mps' (optionally with an index), "
                         f"got {device!r}")
    check_type("train_config", train_config, TrainConfig, "TrainConfig", optional=True)
    check_int("num_threads", num_threads, optional=True)
    return device


def tiny_shakespeare_run(device: str | torch.device = "cpu",
                         train_config: TrainConfig | None = None, seed: int = 0,
                         progress: bool = False, num_threads: int | None = 1,
                         text: str | None = None) -> PretrainedRun:
    """Load the tiny TinyShakespeare model from the cache, training and caching it first
    if needed.

    ``train_config`` defaults to :data:`TINY_TRAIN_CONFIG` (its ``seed`` is replaced by
    ``seed``, which also seeds the weight initialisation). The model trains on ``device``
    and comes back in eval mode. ``num_threads`` is the number of CPU threads torch uses
    while training (restored afterwards): one by default, so that the weights do not
    depend on how many cores the machine has (a matrix product split over another number
    of threads adds its partial sums in another order, and every trained-model number the
    chapters show would change with it). Two threads train about 1.6x faster on an idle
    2-core machine (docs/benchmarks.md); one thread costs that once per cache. ``None``
    keeps torch's setting. ``text`` replaces TinyShakespeare (its checksum goes in the key):
    the tests train on a few hundred characters.
    """
    device = _check_run_args(device, train_config, num_threads)
    config = train_config or TINY_TRAIN_CONFIG
    config = dataclasses.replace(config, seed=seed, device=None)
    text = data.load_text() if text is None else text
    corpus = hashlib.sha256(text.encode("utf-8")).hexdigest()  # goes in the key
    tokenizer = CharTokenizer.from_text(text)
    model_config = GPTConfig.tiny(vocab_size=tokenizer.vocab_size)
    key = cache_key(model_config, config, seed, device, num_threads, corpus)
    path = data.cache_dir() / "models" / key / "model.safetensors"
    with torch.random.fork_rng(devices=_rng_devices(device)):
        _seed(seed, device)
        model = GPT(model_config).to(device)
        if path.exists():
            try:
                history = load_checkpoint(path, model).history
                return PretrainedRun(model.eval(), tokenizer, history, config, path,
                                     trained=False)
            except ValueError as exc:  # an unreadable cache file is rebuilt, not trusted
                warnings.warn(f"ignoring the unreadable cached model at {path} ({exc}); "
                              f"training it again", stacklevel=2)
                _seed(seed, device)
                model = GPT(model_config).to(device)
        ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
        train_ids, val_ids = data.train_val_split(ids, val_fraction=0.1)
        with torch_threads(num_threads):
            history = train(model, train_ids, val_ids, config, progress=progress)
    extra = {"seed": seed, "torch": torch.__version__,
             "tokenizer_chars": "".join(tokenizer.chars)}
    save_checkpoint(path, model, step=config.max_steps, train_config=config,
                    history=history, extra=extra)
    return PretrainedRun(model.eval(), tokenizer, history, config, path, trained=True)


def tiny_shakespeare_model(device: str | torch.device = "cpu",
                           train_config: TrainConfig | None = None, seed: int = 0,
                           progress: bool = False, num_threads: int | None = 1,
                           text: str | None = None) -> tuple[GPT, CharTokenizer]:
    """The trained tiny character-level model (eval mode) and its tokenizer; see
    :func:`tiny_shakespeare_run`."""
    run = tiny_shakespeare_run(device=device, train_config=train_config, seed=seed,
                               progress=progress, num_threads=num_threads, text=text)
    return run.model, run.tokenizer


def _rng_devices(device: str) -> list:
    """Devices whose RNG ``fork_rng`` must save and restore (CPU is always included)."""
    d = torch.device(device)
    if d.type == "cuda":
        return [d.index if d.index is not None else torch.cuda.current_device()]
    return []


def _seed(seed: int, device: str) -> None:
    """Seed the generators the run draws from (inside ``fork_rng``: the caller's are kept)."""
    torch.default_generator.manual_seed(seed)  # weight init happens on the CPU
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed(seed)  # dropout on the GPU
