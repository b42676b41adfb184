import urllib.error

import pytest
import torch

from lib import data


@pytest.fixture()
def isolated(tmp_path, monkeypatch):
    """No shared copy, an empty cache, and no network."""
    monkeypatch.delenv("GPTBOOK_DATA", raising=False)
    monkeypatch.setenv("GPTBOOK_CACHE", str(tmp_path / "cache"))

    def offline(*args, **kwargs):
        raise urllib.error.URLError("network disabled in tests")

    monkeypatch.setattr(data.urllib.request, "urlopen", offline)
    return tmp_path


def small_corpus(tmp_path, text: str = "hello world\n") -> data.Corpus:
    path = tmp_path / "good.txt"
    path.write_text(text)
    return data.Corpus(filename="small.txt", url="https://example.invalid/small.txt",
                       sha256=data.sha256_file(path), n_chars=len(text))


def test_shared_copy_loads_and_matches_checksum():
    text = data.load_text()  # GPTBOOK_DATA (CI) or the cache/download
    assert len(text) == data.TINY_SHAKESPEARE.n_chars
    assert text.startswith("First Citizen:")


def test_missing_offline_is_a_clear_error(isolated):
    with pytest.raises(FileNotFoundError, match="GPTBOOK_DATA"):
        data.corpus_path()
    with pytest.raises(FileNotFoundError, match="download=False"):
        data.corpus_path(download=False)


def test_env_dir_and_cache_are_used(isolated, monkeypatch):
    corpus = small_corpus(isolated)
    shared = isolated / "shared"
    shared.mkdir()
    (shared / "small.txt").write_text("hello world\n")
    monkeypatch.setenv("GPTBOOK_DATA", str(shared))
    assert data.load_text(corpus) == "hello world\n"
    monkeypatch.delenv("GPTBOOK_DATA")
    cache = isolated / "cache"
    cache.mkdir()
    (cache / "small.txt").write_text("hello world\n")
    assert data.corpus_path(corpus) == cache / "small.txt"


@pytest.mark.parametrize("bad", ["hello world", "hello w0rld\n", ""])
def test_corrupted_or_truncated_file_is_never_used(isolated, monkeypatch, bad):
    corpus = small_corpus(isolated)
    shared = isolated / "shared"
    shared.mkdir()
    (shared / "small.txt").write_text(bad)
    monkeypatch.setenv("GPTBOOK_DATA", str(shared))
    with pytest.raises(data.ChecksumError, match="corrupted or truncated"):
        data.load_text(corpus)


def test_download_is_verified_before_it_lands(isolated, monkeypatch):
    import io

    corpus = small_corpus(isolated)

    class Response(io.BytesIO):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(data.urllib.request, "urlopen", lambda url, timeout: Response(b"tampered\n"))
    with pytest.raises(data.ChecksumError):
        data.corpus_path(corpus)
    assert not (isolated / "cache" / "small.txt").exists()
    assert not list((isolated / "cache").glob("*.part"))
    monkeypatch.setattr(data.urllib.request, "urlopen", lambda url, timeout: Response(b"hello world\n"))
    assert data.corpus_path(corpus).read_text() == "hello world\n"


def test_split_and_batches():
    ids = torch.arange(100)
    train, val = data.train_val_split(ids, 0.1)
    assert len(train) == 90 and len(val) == 10 and train[-1] + 1 == val[0]
    g = torch.Generator().manual_seed(0)
    x, y = data.get_batch(train, 4, 8, generator=g)
    assert x.shape == y.shape == (4, 8)
    assert torch.equal(y, x + 1)  # targets are the inputs shifted by one
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert torch.equal(data.get_batch(train, 4, 8, g1)[0], data.get_batch(train, 4, 8, g2)[0])


def test_split_bad_inputs():
    with pytest.raises(ValueError, match="val_fraction"):
        data.train_val_split(torch.arange(10), 1.5)
    with pytest.raises(ValueError, match="data"):
        data.train_val_split(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="too short"):
        data.train_val_split(torch.arange(3), 0.5)


def test_ids_must_be_integers():
    """get_batch runs every training step and checks nothing; train and evaluate check the data
    once per call (tests/test_training.py), and so does the split, where the ids enter."""
    with pytest.raises(TypeError, match="integer tensor of token ids"):
        data.train_val_split(torch.rand(50))


def test_offline_error_is_short_and_names_the_cause(isolated, monkeypatch):
    """The reader sees the message and the cause in one line, not a chained socket traceback."""
    def offline(*args, **kwargs):
        raise urllib.error.URLError(OSError(-3, "Temporary failure in name resolution"))

    monkeypatch.setattr(data.urllib.request, "urlopen", offline)
    with pytest.raises(FileNotFoundError) as info:
        data.corpus_path()
    assert info.value.__cause__ is None and info.value.__suppress_context__
    message = str(info.value)
    assert "URLError" in message and "name resolution" in message and "\n" not in message


def test_gptbook_data_without_the_corpus_is_reported(isolated, monkeypatch):
    empty = isolated / "empty"
    empty.mkdir()
    monkeypatch.setenv("GPTBOOK_DATA", str(empty))
    with pytest.raises(FileNotFoundError, match=f"GPTBOOK_DATA is set to {empty}, which holds no"):
        data.corpus_path()
    with pytest.raises(FileNotFoundError, match="which holds no tinyshakespeare.txt"):
        data.corpus_path(download=False)
