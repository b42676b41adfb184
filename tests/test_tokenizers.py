"""lib.tokenizers: character and byte-level BPE tokenizers, the fast trainer against the naive one,
save/load, and the cl100k_base rebuild against tiktoken itself."""
import json
import random

import pytest
import regex
import torch

from lib import tokenizers as tk
from lib.data import load_text
from lib.tokenizers import BPETokenizer, CharTokenizer

IDS = r"ids must be a list or 1-D tensor of ids in the vocabulary \(ints in 0\.\."
# Ordinary text of many kinds; none of it may be treated as a special token.
VARIED_TEXTS = [
    "Hello, world!",
    "",
    " ",
    "a",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\nprint(f(12))\n",
    'for (int i = 0; i < n; ++i) { sum += a[i]; }\n\t\tif (x != y && z >= 3) return;\r\n',
    '{"key": [1, 2.5, -3e10], "nested": {"a": null, "b": true}}',
    "Crème brûlée, naïve café, façade — “smart quotes” and ‘single’ … ellipsis",
    "日本語のテキストと漢字。中文文本也可以。한국어 텍스트도.",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी, ภาษาไทย",
    "Emoji: 😀😃 👍🏽 👨‍👩‍👧‍👦 🇬🇧🇯🇵 ❤️ ✨🚀",
    "Numbers: 0 7 42 123 1234 12345 1234567890 3.14159 -273.15 1,000,000 1e-9 0x1F 2026-11-21",
    "Phone +44 (0)20 7946 0958, ID 000123, version v1.2.3-rc4",
    "   leading spaces, trailing spaces   ",
    "tabs\there\t\tand\t\t\tthere\n",
    "\n\n\nnew lines\n\n",
    "windows\r\nline\r\nendings\r\n\r\n",
    "lots          of     spaces      between",
    " \t \n \r\n \u00a0 \u2003 mixed whitespace \u3000end",
    "      ",
    "<|endoftext|> looks special but is ordinary text <|fim_prefix|><|fim_middle|><|endofprompt|>",
    "I'm, you're, he's, we'll, they've, I'd, DON'T, WE'LL, It'S, can't, o'clock",
    "CamelCaseIdentifier snake_case_name kebab-case-name SCREAMING_CASE __dunder__",
    "https://example.com/path?query=1&other=two#frag user@example.org",
    "!!!??? ... --- *** ### @@@ $$$ %%% ^^^ &&& ((())) [[]] {{}} <<>> ||| \\\\ //",
    "a" * 500,
    "ab" * 300 + " " + "1" * 40,
    "ﬁ ligature, Ǆ digraph, İstanbul, straße, ß ẞ, K (kelvin) Å (angstrom)",
    "mathematics: ∀x∈ℝ, ∑ᵢ xᵢ² ≤ ∞; α+β=γ",
    "Zero\u200bwidth\u200cjoiners\u200dand\ufeffBOM",
    "lone surrogate \ud800 in the middle",
]


@pytest.fixture(scope="module")
def shakespeare() -> str:
    return load_text()


@pytest.fixture(scope="module")
def cl100k():
    """(our rebuild, tiktoken's own encoding)."""
    return BPETokenizer.from_tiktoken("cl100k_base"), tk.tiktoken_encoding("cl100k_base")


def _random_unicode(rng: random.Random, n: int) -> str:
    ranges = [(0x20, 0x7E), (0x09, 0x0D), (0xA0, 0x24F), (0x370, 0x52F), (0x590, 0x6FF), (0x900, 0x97F),
              (0x3040, 0x30FF), (0x4E00, 0x4FFF), (0xAC00, 0xAD00), (0x1F300, 0x1F64F), (0x2000, 0x206F)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


# --------------------------------------------------------------------------------------------------
# CharTokenizer
# --------------------------------------------------------------------------------------------------

def test_char_tokenizer_round_trip_and_sorted_vocabulary():
    tok = CharTokenizer.from_text("hello world")
    assert tok.chars == sorted(set("hello world"))
    assert tok.vocab_size == 8
    ids = tok.encode("low hole")
    assert ids == [tok.chars.index(c) for c in "low hole"]
    assert tok.decode(ids) == "low hole"
    assert tok.decode(torch.tensor(ids)) == "low hole"
    assert tok.encode("") == [] and tok.decode([]) == ""


def test_char_tokenizer_on_shakespeare(shakespeare):
    tok = CharTokenizer.from_text(shakespeare)
    assert tok.vocab_size == 65
    assert tok.decode(tok.encode(shakespeare[:5000])) == shakespeare[:5000]


def test_char_tokenizer_unknown_character_is_named():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"'z'.*position 2"):
        tok.encode("abz")


@pytest.mark.parametrize("call, error, match", [
    (lambda: CharTokenizer.from_text(""), ValueError, "empty"),
    (lambda: CharTokenizer.from_text(None), TypeError, "text must be a str"),
    (lambda: CharTokenizer.from_text(b"abc"), TypeError, "text must be a str"),
    (lambda: CharTokenizer("abc"), ValueError, "chars must be a non-empty list"),
    (lambda: CharTokenizer([]), ValueError, "non-empty"),
    (lambda: CharTokenizer(["a", "bc"]), ValueError, "single characters, got \\['a', 'bc'\\]"),
    (lambda: CharTokenizer(["a", "a"]), ValueError, "distinct"),
    (lambda: CharTokenizer.from_text("abc").encode(["a"]), TypeError, "text must be a str"),
    (lambda: CharTokenizer.from_text("abc").decode("ab"), ValueError, IDS + r"2\), got 'ab'"),
    (lambda: CharTokenizer.from_text("abc").decode([0, 1.0]), ValueError, "got 1.0"),
    (lambda: CharTokenizer.from_text("abc").decode([True]), ValueError, "got True"),
    (lambda: CharTokenizer.from_text("abc").decode([3]), ValueError, "got 3"),
    (lambda: CharTokenizer.from_text("abc").decode([-1]), ValueError, "got -1"),
    (lambda: CharTokenizer.from_text("abc").decode(torch.zeros(2, 2, dtype=torch.long)), ValueError,
     r"got \[0, 0\]"),
])
def test_char_tokenizer_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --------------------------------------------------------------------------------------------------
# BPE building blocks and the two trainers
# --------------------------------------------------------------------------------------------------

def test_merge_pair_scans_left_to_right_without_overlap():
    assert tk.merge_pair([7, 7, 7], (7, 7), 9) == [9, 7]
    assert tk.merge_pair([7, 7, 7, 7], (7, 7), 9) == [9, 9]
    assert tk.merge_pair([1, 2, 3, 1, 2], (1, 2), 5) == [5, 3, 5]
    assert tk.merge_pair([1], (1, 2), 5) == [1]
    assert tk.merge_pair([], (1, 2), 5) == []


def test_split_pattern_keeps_words_numbers_and_spaces_apart():
    assert tk.split_text("Hello world, it's 12345!!\n\n  ok") == [
        "Hello", " world", ",", " it", "'s", " ", "123", "45", "!!\n\n", " ", " ok"]
    assert tk.split_text("Hello world", tk.GPT2_SPLIT_PATTERN) == ["Hello", " world"]


def test_chunk_counts_count_distinct_chunks():
    counts = tk.chunk_counts("the cat the hat the")
    assert counts == {"the": 1, " the": 2, " cat": 1, " hat": 1}


def test_learn_merges_picks_most_frequent_pair_smallest_on_ties():
    # "ab" twice and "cd" twice: a tie; (97, 98) < (99, 100) so "ab" goes first.
    result = tk.learn_merges({"cd": 2, "ab": 2}, 2)
    assert result.merges == [(97, 98), (99, 100)]
    assert result.pair_counts == [2, 2]
    assert result.n_tokens == [8, 6, 4]
    result = tk.learn_merges({"xy": 1, "zz": 5}, 1)
    assert result.merges == [(122, 122)]


def test_learn_merges_stops_when_no_pair_is_left():
    result = tk.learn_merges({"abc": 3}, 10)
    assert result.merges == [(97, 98), (256, 99)]
    assert result.n_tokens == [9, 6, 3]


def test_learn_merges_handles_overlapping_pairs():
    for chunks in ({"aaaa": 1}, {"aaa": 2, "aaaaa": 1}, {"abab": 1, "baba": 3}):
        fast, naive = tk.learn_merges(chunks, 6), tk.learn_merges_naive(chunks, 6)
        assert fast == naive


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_and_naive_trainers_agree_on_random_text(seed):
    rng = random.Random(seed)
    words = ["".join(rng.choice("aabbcde") for _ in range(rng.randint(1, 8))) for _ in range(300)]
    text = " ".join(words) + " " + _random_unicode(rng, 200)
    counts = tk.chunk_counts(text)
    fast, naive = tk.learn_merges(counts, 150), tk.learn_merges_naive(counts, 150)
    assert fast.merges == naive.merges
    assert fast.n_tokens == naive.n_tokens
    assert fast.pair_counts == naive.pair_counts


def test_fast_and_naive_trainers_agree_on_shakespeare(shakespeare):
    counts = tk.chunk_counts(shakespeare[:100_000])
    fast, naive = tk.learn_merges(counts, 144), tk.learn_merges_naive(counts, 144)
    assert fast == naive
    assert len(fast.merges) == 144
    assert fast.n_tokens == sorted(fast.n_tokens, reverse=True)  # every merge shortens the text


@pytest.mark.parametrize("call, error, match", [
    (lambda: tk.learn_merges(["ab"], 3), ValueError, "chunks must map each chunk"),
    (lambda: tk.learn_merges({1: 2}, 3), ValueError, r"\(str or bytes\)"),
    (lambda: tk.learn_merges({"ab": 0}, 3), ValueError, "positive int count"),
    (lambda: tk.learn_merges({"ab": 1}, -1), ValueError, "n_merges must be an int >= 0, got -1"),
    (lambda: tk.learn_merges({"ab": 1}, 2.0), ValueError, "n_merges"),
    (lambda: tk.learn_merges_naive({"ab": 1}, "2"), ValueError, "n_merges"),
    (lambda: tk.split_text(b"bytes"), TypeError, "text must be a str"),
    (lambda: tk.split_text("x", pattern="(unclosed"), ValueError, "pattern"),
])
def test_trainer_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --------------------------------------------------------------------------------------------------
# BPETokenizer
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(shakespeare) -> BPETokenizer:
    return BPETokenizer.train(shakespeare[:100_000], 400)


def test_train_learns_requested_vocabulary(trained, shakespeare):
    assert trained.vocab_size == 400
    assert len(trained.merges) == 144
    assert list(trained.merges.values()) == list(range(256, 400))
    counts = tk.chunk_counts(shakespeare[:100_000])
    assert list(trained.merges) == tk.learn_merges(counts, 144).merges  # = naive's (test above)
    for new_id, (a, b) in zip(range(256, 400), trained.merges):
        assert trained.vocab[new_id] == trained.vocab[a] + trained.vocab[b]


def test_encoding_the_training_text_matches_the_training_count(trained, shakespeare):
    counts = tk.chunk_counts(shakespeare[:100_000])
    result = tk.learn_merges(counts, 144)
    assert len(trained.encode(shakespeare[:100_000])) == result.n_tokens[-1]


@pytest.mark.parametrize("text", VARIED_TEXTS[:-1])
def test_trained_round_trip_on_any_text(trained, text):
    ids = trained.encode(text)
    assert all(0 <= i < trained.vocab_size for i in ids)
    assert trained.decode(ids) == text
    assert len(ids) <= len(text.encode("utf-8"))


def test_tokens_never_cross_chunk_boundaries(trained, shakespeare):
    text = shakespeare[200_000:203_000]
    per_chunk = [i for chunk in tk.split_text(text) for i in trained.encode(chunk)]
    assert trained.encode(text) == per_chunk


def test_encoding_is_cached_and_repeatable(trained):
    text = "To be, or not to be, that is the question."
    first = trained.encode(text)
    assert set(tk.split_text(text)) <= set(trained._cache)  # chunk encodings are remembered
    uncached = [i for chunk in tk.split_text(text)
                for i in tk.encode_chunk(chunk.encode("utf-8"), trained.byte_ids, trained.merges)]
    assert trained.encode(text) == first == uncached


def test_vocab_256_is_plain_bytes():
    tok = BPETokenizer.train("hello hello hello", 256)
    assert tok.merges == {} and tok.vocab_size == 256
    assert tok.encode("héllo") == list("héllo".encode("utf-8"))


def test_training_stops_early_on_a_tiny_text():
    tok = BPETokenizer.train("ab ab", 1000)
    assert tok.vocab_size == 258  # "ab" (twice), then " " + "ab": every chunk is one token
    assert tok.encode("ab ab") == [256, 257]


def test_decode_accepts_tensors_and_replaces_broken_utf8(trained):
    ids = trained.encode("café")
    assert trained.decode(torch.tensor(ids)) == "café"
    assert trained.decode_bytes(ids) == "café".encode("utf-8")
    assert trained.decode([0xC3]) == "\ufffd"  # half of a two-byte character


@pytest.mark.parametrize("vocab_size", [0, -5, 100, 255, 512.0, "512", True, None])
def test_train_rejects_bad_vocab_size(vocab_size):
    with pytest.raises(ValueError, match=f"vocab_size must be an int >= 256 .*got {vocab_size!r}"):
        BPETokenizer.train("some text", vocab_size)


@pytest.mark.parametrize("call, error, match", [
    (lambda t: BPETokenizer.train(b"bytes", 300), TypeError, "text must be a str"),
    (lambda t: BPETokenizer.train(["a"], 300), TypeError, "text must be a str"),
    (lambda t: BPETokenizer.train("abc", 300, pattern=None), ValueError, "pattern"),
    (lambda t: BPETokenizer.train("abc", 300, pattern="[unclosed"), ValueError, "pattern"),
    (lambda t: t.encode(None), TypeError, "text must be a str"),
    (lambda t: t.encode(b"abc"), TypeError, "text must be a str"),
    (lambda t: t.decode("abc"), ValueError, IDS + "399"),
    (lambda t: t.decode([1, "2"]), ValueError, "got '2'"),
    (lambda t: t.decode([400]), ValueError, "got 400"),
    (lambda t: t.decode([-3]), ValueError, "got -3"),
    (lambda t: BPETokenizer({(1, 2): 256}, byte_ids=[0, 1]), ValueError, "byte_ids"),
    (lambda t: BPETokenizer({(1, 300): 256}), ValueError, "earlier merges"),
    (lambda t: BPETokenizer({(1, 2): 65}), ValueError, r"new int id, got \(1, 2\) -> 65"),
    (lambda t: BPETokenizer({(1,): 256}), ValueError, r"got \(1,\) -> 256"),
    (lambda t: BPETokenizer({(1, True): 256}), ValueError, "two known ids"),
    (lambda t: BPETokenizer([(1, 2)]), TypeError, "merges"),
])
def test_bpe_bad_inputs(trained, call, error, match):
    with pytest.raises(error, match=match):
        call(trained)


def test_save_load_round_trip(trained, tmp_path, shakespeare):
    path = trained.save(tmp_path / "bpe.json")
    loaded = BPETokenizer.load(path)
    assert loaded.merges == trained.merges
    assert loaded.pattern == trained.pattern
    assert loaded.byte_ids == trained.byte_ids
    assert loaded.vocab == trained.vocab
    text = shakespeare[500_000:510_000] + VARIED_TEXTS[10]
    assert loaded.encode(text) == trained.encode(text)
    assert BPETokenizer.load(str(path)).vocab_size == 400  # str paths work too


def test_save_load_keeps_tiktoken_ids(cl100k, tmp_path):
    ours, _ = cl100k
    loaded = BPETokenizer.load(ours.save(tmp_path / "cl100k.json"))
    assert loaded.byte_ids == ours.byte_ids
    assert loaded.encode(VARIED_TEXTS[4] + VARIED_TEXTS[8]) == ours.encode(VARIED_TEXTS[4] + VARIED_TEXTS[8])


def test_load_rejects_other_files(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    with pytest.raises(ValueError, match="not a tokenizer written by BPETokenizer.save: Expecting"):
        BPETokenizer.load(bad_json)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="format"):
        BPETokenizer.load(other)
    future = tmp_path / "future.json"
    future.write_text(json.dumps({"format": "gptbook-bpe", "version": 99}))
    with pytest.raises(ValueError, match="version"):
        BPETokenizer.load(future)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"format": "gptbook-bpe", "version": 1, "pattern": "x", "byte_ids": [1],
                                  "merges": []}))
    with pytest.raises(ValueError, match="byte_ids"):
        BPETokenizer.load(broken)
    with pytest.raises(FileNotFoundError):
        BPETokenizer.load(tmp_path / "missing.json")


# --------------------------------------------------------------------------------------------------
# cl100k_base: our rebuild against tiktoken
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", VARIED_TEXTS, ids=range(len(VARIED_TEXTS)))
def test_from_tiktoken_encodes_exactly_like_tiktoken(cl100k, text):
    ours, enc = cl100k
    ids = ours.encode(text)
    assert ids == enc.encode_ordinary(text)
    assert ours.decode(ids) == enc.decode(ids)


def test_from_tiktoken_matches_on_random_unicode(cl100k):
    ours, enc = cl100k
    rng = random.Random(1234)
    for _ in range(200):
        text = _random_unicode(rng, rng.randint(1, 60))
        assert ours.encode(text) == enc.encode_ordinary(text), repr(text)


def test_from_tiktoken_matches_on_shakespeare(cl100k, shakespeare):
    ours, enc = cl100k
    text = shakespeare[:300_000]
    assert ours.encode(text) == enc.encode_ordinary(text)


def test_from_tiktoken_has_tiktokens_vocabulary(cl100k):
    ours, enc = cl100k
    assert ours.vocab_size == len(enc._mergeable_ranks) == 100256
    assert len(ours.merges) == 100256 - 256
    rng = random.Random(0)
    for i in rng.sample(range(ours.vocab_size), 2000):
        assert ours.vocab[i] == enc.decode_single_token_bytes(i)


def test_gpt4_split_pattern_splits_like_cl100k(cl100k):
    _, enc = cl100k
    theirs = regex.compile(enc._pat_str)
    for text in VARIED_TEXTS:
        assert tk.split_text(text) == theirs.findall(text)


def test_tiktoken_encoding_bad_names():
    with pytest.raises(ValueError, match="name must be one of"):
        tk.tiktoken_encoding("no_such_encoding")
    with pytest.raises(ValueError, match="name must be one of"):
        tk.tiktoken_encoding(100)
    with pytest.raises(ValueError, match="name must be one of"):
        BPETokenizer.from_tiktoken("cl100k")


def test_tiktoken_offline_error_is_short_and_names_the_cause(monkeypatch, tmp_path):
    import tiktoken

    def offline(name):
        raise ConnectionError("HTTPSConnectionPool(host='openaipublic.blob.core.windows.net', port=443): "
                              "Max retries exceeded\n with url: /encodings/cl100k_base.tiktoken")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="TIKTOKEN_CACHE_DIR") as info:
        tk.tiktoken_encoding("cl100k_base")
    assert info.value.__cause__ is None and info.value.__suppress_context__
    message = str(info.value)
    assert "ConnectionError" in message and str(tmp_path) in message and "\n" not in message


# --------------------------------------------------------------------------------------------------
# ChatTokenizer (SmolLM2's own, against transformers and Rust tokenizers: tests/test_smollm.py)
# --------------------------------------------------------------------------------------------------

def test_token_spans_start_where_tiktoken_says(cl100k):
    """The character spans behind ChatTokenizer's assistant mask: each token's start equals
    tiktoken's decode_with_offsets, emoji and characters split over two tokens included."""
    ours, enc = cl100k
    for text in VARIED_TEXTS:
        ids, spans = tk._encode_with_spans(ours, text)
        assert ids == ours.encode(text)
        assert [start for start, _ in spans] == enc.decode_with_offsets(ids)[1], text
        assert all(start < end for start, end in spans)


def test_token_spans_step_over_bytes_without_a_token():
    """A vocabulary without byte 0x04 drops it (as Hugging Face's BPE does); the spans of the
    tokens after it, and of a merge around it, still point at their own characters."""
    byte_ids = [None if b == 4 else b for b in range(256)]
    bpe = BPETokenizer({(ord(" "), ord("!")): 256}, tk.GPT2_SPLIT_PATTERN, byte_ids)
    text = "x \x04!?\x04 é"
    ids, spans = tk._encode_with_spans(bpe, text)
    assert ids == bpe.encode(text) == [ord("x"), 256, ord("?"), ord(" "), 0xC3, 0xA9]
    assert spans == [(0, 1), (1, 4), (4, 5), (6, 7), (7, 8), (7, 8)]  # " !" is text[1:4]


def chat_tokenizer(template, eos_id=None, bos_id=None) -> tk.ChatTokenizer:
    """Bytes as ids 0-255, three special tokens 256-258."""
    special = {"<|start|>": 256, "<|eot|>": 257, "<|end_of_text|>": 258}
    return tk.ChatTokenizer(BPETokenizer({}, byte_ids=list(range(256))), special, template,
                            eos_id=eos_id, bos_id=bos_id)


def test_end_of_turn_is_what_the_template_writes_after_an_assistant_message():
    """Llama 3's layout ends a turn with <|eot|> and names <|end_of_text|> as eos: the turn
    ends at <|eot|>. A template that writes no special token after a message, or none at
    all, leaves eos."""
    llama3 = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n\n"
              "{{ m['content'] }}<|eot|>{% endfor %}")
    tok = chat_tokenizer(llama3, eos_id=258, bos_id=256)
    assert tok.end_of_turn_id == 257 and tok.eos_id == 258
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert chat_tokenizer(plain, eos_id=258).end_of_turn_id == 258
    assert chat_tokenizer(None, eos_id=258).end_of_turn_id == 258
    chat = [{"role": "user", "content": "hi <|eot|>"}]
    assert tok.apply_chat_template(chat) == "<|start|><|start|>user\n\nhi <|eot|><|eot|>"
    assert tok.encode_chat(chat) == [256, 256, *b"user\n\nhi ", *b"<|eot|>", 257]


def test_chat_tokenizer_bad_inputs():
    with pytest.raises(ValueError, match="eos_id and bos_id must be None or ids in the vocab"):
        chat_tokenizer(None, eos_id=300)
    with pytest.raises(TypeError, match="chat_template None or a str"):
        chat_tokenizer(b"{{ messages }}")
    with pytest.raises(ValueError, match="this tokenizer has no chat_template"):
        chat_tokenizer(None).apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="messages must be a list of"):
        chat_tokenizer("{{ messages }}").encode_chat("hi")


def test_a_template_that_refuses_the_probe_still_builds_a_tokenizer():
    """A template may insist on a system message first; finding its end-of-turn token must
    not make the tokenizer unusable: it falls back to eos, and encoding still works."""
    strict = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}"
              "{% endif %}{% for m in messages %}<|start|>{{ m['content'] }}<|eot|>{% endfor %}")
    tok = chat_tokenizer(strict, eos_id=258)
    assert tok.end_of_turn_id == 258
    assert tok.encode("hi") == [ord("h"), ord("i")]
    with pytest.raises(Exception, match="system first"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
