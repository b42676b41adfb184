"""The TinyShakespeare corpus: find or download it (checksum-verified), split it, sample batches.

Where the text comes from, in order:

1. the folder named by the environment variable ``GPTBOOK_DATA`` (CI points it at a shared copy),
2. the cache folder (``GPTBOOK_CACHE``, default ``~/.cache/gpt-from-the-ground-up``),
3. a download from the canonical public URL into the cache.

Every file is checked against its SHA-256 before use; a corrupted or truncated copy is never used.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

from lib.checks import check_number, check_token_ids


@dataclass(frozen=True)
class Corpus:
    """A text file we know by name, size and checksum."""

    filename: str
    url: str
    sha256: str
    n_chars: int


TINY_SHAKESPEARE = Corpus(
    filename="tinyshakespeare.txt",
    url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
    sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
    n_chars=1_115_394,
)


class ChecksumError(RuntimeError):
    """A data file exists but its SHA-256 is not the expected one."""


def cache_dir() -> Path:
    """The folder where downloads (and trained models) are cached."""
    return Path(os.environ.get("GPTBOOK_CACHE", Path.home() / ".cache" / "gpt-from-the-ground-up"))


def sha256_file(path: str | Path) -> str:
    """The SHA-256 of a file, as 64 hex digits (read in 1 MiB chunks). The library's one file
    hash: data files, GGUF files, downloaded wheels."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _verified(path: Path, corpus: Corpus) -> Path:
    actual = sha256_file(path)
    if actual != corpus.sha256:
        raise ChecksumError(
            f"{path} has SHA-256 {actual}, expected {corpus.sha256} for {corpus.filename}: the file is "
            f"corrupted or truncated. Delete it and run again, or replace it with a good copy from {corpus.url}"
        )
    return path


def _download(corpus: Corpus, dest: Path, timeout: float) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=dest.name, suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(corpus.url, timeout=timeout) as response:
            while chunk := response.read(1 << 20):
                out.write(chunk)
        _verified(tmp, corpus)  # never move a bad download into place
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def corpus_path(corpus: Corpus = TINY_SHAKESPEARE, download: bool = True, timeout: float = 30.0) -> Path:
    """Return the path of a verified copy of ``corpus``, downloading it into the cache if needed."""
    data_dir = os.environ.get("GPTBOOK_DATA")
    if data_dir:
        candidate = Path(data_dir) / corpus.filename
        if candidate.exists():
            return _verified(candidate, corpus)
    cached = cache_dir() / corpus.filename
    if cached.exists():
        return _verified(cached, corpus)
    if not download:
        raise FileNotFoundError(_missing_message(corpus, cached, "download=False", data_dir))
    try:
        return _download(corpus, cached, timeout)
    except (urllib.error.URLError, OSError) as exc:  # a ChecksumError is neither: it propagates
        # The message says what failed; the socket-level traceback would only bury it.
        why = f"the download failed: {_summary(exc)}"
        raise FileNotFoundError(_missing_message(corpus, cached, why, data_dir)) from None


def _summary(exc: BaseException, limit: int = 160) -> str:
    """One line naming an exception, e.g. 'URLError: [Errno -3] Temporary failure in name resolution'."""
    reason = getattr(exc, "reason", None) if isinstance(exc, urllib.error.URLError) else None
    text = f"{type(exc).__name__}: {reason if reason is not None else exc}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _missing_message(corpus: Corpus, cached: Path, why: str, data_dir: str | None = None) -> str:
    where = (f"GPTBOOK_DATA is set to {data_dir}, which holds no {corpus.filename}. " if data_dir else "")
    return (
        f"{corpus.filename} is not available ({why}). {where}Put a copy (SHA-256 {corpus.sha256}) at "
        f"{cached}, or in a folder named by the environment variable GPTBOOK_DATA. It can be downloaded "
        f"from {corpus.url}"
    )


def load_text(corpus: Corpus = TINY_SHAKESPEARE, download: bool = True) -> str:
    """The corpus as one string (TinyShakespeare by default)."""
    return corpus_path(corpus, download=download).read_text(encoding="utf-8")


def train_val_split(data: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 1-D token tensor into a leading training part and a trailing validation part."""
    check_token_ids("data", data, dim=1)
    check_number("val_fraction", val_fraction, 0, 1, low_open=True, high_open=True)
    n_train = int(len(data) * (1.0 - val_fraction))
    if n_train < 2 or len(data) - n_train < 2:
        raise ValueError(f"data of length {len(data)} is too short to split with val_fraction={val_fraction}")
    return data[:n_train], data[n_train:]


def get_batch(
    data: torch.Tensor,
    batch_size: int,
    context_length: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    rows: slice | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``batch_size`` random windows: inputs ``x`` and targets ``y`` (``x`` shifted by one).

    Shapes: ``x, y ∈ (batch_size, context_length)``; ``y[b, t] == data[i_b + t + 1]``. ``data`` is a
    1-D tensor of at least ``context_length + 1`` token ids; this runs every training step, so it
    does not check that (``train`` and ``evaluate`` check their data once per call).
    ``rows`` keeps only those rows of the sampled batch (a data-parallel process's slice, see
    :func:`lib.distributed.batch_rows`): the generator draws the whole batch either way, so every
    process advances it alike, and only the kept rows are gathered and copied to ``device``. On
    CUDA the copy goes from pinned (page-locked) memory without blocking, so it overlaps the GPU's
    work instead of waiting for it.
    """
    starts = torch.randint(len(data) - context_length, (batch_size,), generator=generator)
    if rows is not None:
        starts = starts[rows]
    offsets = torch.arange(context_length)
    x = data[starts[:, None] + offsets]  # (B, T)
    y = data[starts[:, None] + offsets + 1]  # (B, T)
    if torch.device(device).type == "cuda" and x.device.type == "cpu":
        return (x.pin_memory().to(device, non_blocking=True),
                y.pin_memory().to(device, non_blocking=True))
    return x.to(device), y.to(device)
