"""Tokenizers: turn text into integer ids and back.

- :class:`CharTokenizer`: one id per character seen in a training text (the tiny model's tokenizer).
- :class:`BPETokenizer`: byte-level byte-pair encoding with a regex pre-split, as in GPT-2 and GPT-4:
  ``train``, ``encode``, ``decode``, ``save``, ``load``, and ``from_tiktoken("cl100k_base")``, which
  rebuilds OpenAI's tokenizer from its ranks and encodes ordinary text exactly as tiktoken does.
- :func:`learn_merges` (fast, incremental pair counts) and :func:`learn_merges_naive` (the slow
  reference that recounts every pair after every merge); both return identical merges.
- :func:`encode_chunk`: BPE on one pre-split chunk (what ``BPETokenizer.encode`` runs per chunk).

Training and encoding work on the *unique* pre-split chunks of a text with their counts, never on the
whole text, so TinyShakespeare (about 300k chunks but only about 14k distinct ones) trains in seconds.
"""
from __future__ import annotations

import heapq
import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

import regex

Pair = tuple[int, int]

# GPT-2's pre-split: contractions, optional space + letters, optional space + digits, optional space +
# other symbols, then whitespace (a run of spaces keeps its last space for the next word).
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# cl100k_base's pre-split (GPT-3.5/GPT-4): case-insensitive contractions, a letter run with at most one
# leading non-letter, digits in groups of at most three, symbol runs with their newlines, whitespace.
GPT4_SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
# SmolLM2's pre-split (its tokenizer.json: Digits(individual_digits=True), then ByteLevel's GPT-2 regex;
# llama.cpp calls it "smollm"): every digit (Unicode category N) is a chunk of its own, and GPT-2's
# pattern runs on the text between digits. Written as one pattern: a digit ends the text GPT-2's
# pattern sees, so a whitespace run before a digit stays one chunk (the lookahead treats a digit like
# the end of the text), where GPT-2's pattern splits the run's last character off.
SMOLLM_SPLIT_PATTERN = (r"""\p{N}|'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?[^\s\p{L}\p{N}]+"""
                        r"""|\s+(?![^\s\p{N}])|\s+""")

_FORMAT = "gptbook-bpe"
_FORMAT_VERSION = 1
_CACHE_LIMIT = 1 << 18  # chunk encodings kept per tokenizer before the cache is cleared


# --------------------------------------------------------------------------------------------------
# Argument checks shared by both tokenizers
# --------------------------------------------------------------------------------------------------

def _check_text(text: Any, name: str = "text") -> str:
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
    return text


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _as_id_list(ids: Any, vocab_size: int, known: Mapping[int, Any] | None = None) -> list[int]:
    """``ids`` (a list of ints or a 1-D integer tensor/array) as a list of Python ints in the
    vocabulary: ``0 <= id < vocab_size``, and a key of ``known`` when given."""
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    bad = (ids if isinstance(ids, str) or not isinstance(ids, (list, tuple)) else
           next((i for i in ids if not (_is_int(i) and 0 <= i < vocab_size)
                 or (known is not None and i not in known)), None))
    if bad is not None:
        raise ValueError(f"ids must be a list or 1-D tensor of ids in the vocabulary (ints in "
                         f"0..{vocab_size - 1}), got {bad!r}")
    return list(ids)


def _compile_pattern(pattern: Any) -> regex.Pattern:
    try:
        return regex.compile(pattern)
    except (regex.error, TypeError) as exc:
        raise ValueError(f"pattern must be a regular expression (a str): {exc}") from exc


# --------------------------------------------------------------------------------------------------
# Character-level tokenizer
# --------------------------------------------------------------------------------------------------

class CharTokenizer:
    """One id per character: ``chars[i]`` has id ``i``.

    Built from a text with :meth:`from_text` (ids follow sorted character order). A character that is
    not in the vocabulary cannot be encoded: :meth:`encode` raises a ValueError naming it.
    """

    def __init__(self, chars: Sequence[str]) -> None:
        if (not isinstance(chars, (list, tuple)) or not chars or len(set(chars)) != len(chars)
                or not all(isinstance(c, str) and len(c) == 1 for c in chars)):
            raise ValueError(f"chars must be a non-empty list of distinct single characters, "
                             f"got {chars!r:.200}")
        self.chars: list[str] = list(chars)
        self.stoi: dict[str, int] = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        """The tokenizer whose vocabulary is every distinct character of ``text``, sorted."""
        if not _check_text(text):
            raise ValueError("text must not be empty: the vocabulary is built from its characters")
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        """Number of distinct ids."""
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Ids of the characters of ``text``; an unknown character raises ValueError."""
        _check_text(text)
        stoi = self.stoi
        try:
            return [stoi[c] for c in text]
        except KeyError:
            pos = next(i for i, c in enumerate(text) if c not in stoi)
            raise ValueError(f"character {text[pos]!r} (at position {pos}) is not in the vocabulary of "
                             f"{self.vocab_size} characters") from None

    def decode(self, ids: Sequence[int]) -> str:
        """The text of a list (or 1-D tensor) of ids."""
        return "".join(self.chars[i] for i in _as_id_list(ids, self.vocab_size))

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


# --------------------------------------------------------------------------------------------------
# Byte-pair encoding: the pieces
# --------------------------------------------------------------------------------------------------

def split_text(text: str, pattern: str = GPT4_SPLIT_PATTERN) -> list[str]:
    """Pre-split ``text`` into chunks with ``pattern``; BPE never merges across chunk boundaries."""
    return _compile_pattern(pattern).findall(_check_text(text))


def chunk_counts(text: str, pattern: str = GPT4_SPLIT_PATTERN) -> Counter[str]:
    """How often each distinct chunk of ``text`` occurs (the training data of BPE)."""
    return Counter(split_text(text, pattern))


def merge_pair(ids: Sequence[int], pair: Pair, new_id: int) -> list[int]:
    """Replace each occurrence of ``pair`` in ``ids`` with ``new_id``, scanning left to right.

    Occurrences never overlap: ``merge_pair([7, 7, 7], (7, 7), 9) == [9, 7]``.
    """
    a, b = pair
    out: list[int] = []
    i, n = 0, len(ids)
    while i < n:
        if i < n - 1 and ids[i] == a and ids[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def _training_data(chunks: Mapping[str, int] | Mapping[bytes, int],
                   n_merges: int) -> tuple[list[list[int]], list[int]]:
    """The trainers' inputs, checked: each chunk's bytes as a list of ids, and its count."""
    items = list(chunks.items()) if isinstance(chunks, Mapping) else [(chunks, None)]
    if not all(isinstance(c, (str, bytes)) and _is_int(n) and n > 0 for c, n in items):
        raise ValueError(f"chunks must map each chunk (str or bytes) to a positive int count, "
                         f"as chunk_counts(text) does; got {chunks!r:.100}")
    if not _is_int(n_merges) or n_merges < 0:
        raise ValueError(f"n_merges must be an int >= 0, got {n_merges!r}")
    words = [list(c.encode("utf-8") if isinstance(c, str) else c) for c, _ in items]
    return words, [n for _, n in items]


@dataclass(frozen=True)
class MergeResult:
    """What training learned: ``merges[k]`` became id ``256 + k``; ``n_tokens[k]`` is the length of the
    training text in tokens after ``k`` merges (so ``n_tokens[0]`` is its length in bytes)."""

    merges: list[Pair]
    n_tokens: list[int]
    pair_counts: list[int]  # how often merges[k] occurred when it was chosen


def learn_merges_naive(chunks: Mapping[str, int], n_merges: int) -> MergeResult:
    """Slow reference BPE trainer: after every merge, recount every pair of every chunk.

    Picks the most frequent pair, ties broken by the smaller pair ``(a, b)``; stops early when no
    pair is left (every chunk is a single token). Same result as :func:`learn_merges`.
    """
    words, freqs = _training_data(chunks, n_merges)
    merges: list[Pair] = []
    counts_chosen: list[int] = []
    n_tokens = [sum(len(w) * f for w, f in zip(words, freqs))]
    for k in range(n_merges):
        counts: dict[Pair, int] = defaultdict(int)
        for w, f in zip(words, freqs):
            for pair in zip(w, w[1:]):
                counts[pair] += f
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        words = [merge_pair(w, best, 256 + k) for w in words]
        merges.append(best)
        counts_chosen.append(counts[best])
        n_tokens.append(sum(len(w) * f for w, f in zip(words, freqs)))
    return MergeResult(merges, n_tokens, counts_chosen)


def learn_merges(chunks: Mapping[str, int], n_merges: int) -> MergeResult:
    """Fast BPE trainer: keep pair counts and, per pair, the chunks that contain it;
    after a merge, update only the chunks where the merged pair occurred.

    A heap with lazy deletion finds the most frequent pair (ties: the smaller pair).
    Returns exactly what :func:`learn_merges_naive` returns.
    """
    words, freqs = _training_data(chunks, n_merges)
    counts: dict[Pair, int] = defaultdict(int)
    where: dict[Pair, set[int]] = defaultdict(set)  # pair -> chunks that may contain it
    for i, (w, f) in enumerate(zip(words, freqs)):
        for pair in zip(w, w[1:]):
            counts[pair] += f
            where[pair].add(i)
    heap = [(-c, p) for p, c in counts.items()]
    heapq.heapify(heap)
    merges, counts_chosen = [], []  # the pairs chosen, and their counts then
    n_tokens = [sum(len(w) * f for w, f in zip(words, freqs))]
    while len(merges) < n_merges:
        while heap and counts.get(heap[0][1], 0) != -heap[0][0]:
            heapq.heappop(heap)  # stale: the pair's count changed since it was pushed
        if not heap:
            break
        neg_count, best = heapq.heappop(heap)
        new_id = 256 + len(merges)
        touched, removed = set(), 0  # pairs whose counts changed; tokens saved
        for i in where.pop(best):
            w, f = words[i], freqs[i]
            new_w = merge_pair(w, best, new_id)
            if len(new_w) == len(w):
                continue  # stale index: an earlier merge consumed this pair here
            for pair in zip(w, w[1:]):
                counts[pair] -= f
            for pair in zip(new_w, new_w[1:]):
                counts[pair] += f
                where[pair].add(i)
            touched.update(zip(w, w[1:]), zip(new_w, new_w[1:]))
            removed += (len(w) - len(new_w)) * f
            words[i] = new_w
        for pair in touched:
            c = counts[pair]
            if c > 0:
                heapq.heappush(heap, (-c, pair))
            else:
                del counts[pair]
                where.pop(pair, None)
        merges.append(best)
        counts_chosen.append(-neg_count)
        n_tokens.append(n_tokens[-1] - removed)
    return MergeResult(merges, n_tokens, counts_chosen)


# --------------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------------

def _build_vocab(merges: Mapping[Pair, int], byte_ids: Sequence[int | None]) -> dict[int, bytes]:
    """Each id's bytes: every byte's id, then each merge's two parts joined, in id order.
    Checks what a tokenizer is built from (where the data enters)."""
    ids = ([i for i in byte_ids if i is not None]
           if isinstance(byte_ids, (list, tuple, range)) and len(byte_ids) == 256 else [])
    if not ids or len(set(ids)) != len(ids) or not all(_is_int(i) and i >= 0 for i in ids):
        raise ValueError("byte_ids must be 256 distinct ints >= 0, the id of each byte value "
                         "(None for a byte the vocabulary lacks)")
    if not isinstance(merges, Mapping):
        raise TypeError(f"merges must map (id, id) -> new id, got {type(merges).__name__}")
    vocab = {i: bytes([b]) for b, i in enumerate(byte_ids) if i is not None}
    for pair, new_id in sorted(merges.items(), key=lambda kv: kv[1]):
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(_is_int(x) and x in vocab
                for x in pair) and _is_int(new_id) and new_id not in vocab):
            raise ValueError(f"merges must map two known ids (bytes or earlier merges) to a new "
                             f"int id, got {pair!r} -> {new_id!r}")
        vocab[new_id] = vocab[pair[0]] + vocab[pair[1]]
    return vocab


def encode_chunk(chunk: bytes, byte_ids: Sequence[int | None], merges: Mapping[Pair, int]) -> list[int]:
    """BPE on one chunk: its bytes' ids, then repeatedly merge the adjacent pair of lowest rank.
    A byte without a token (``byte_ids[b] is None``) is dropped, as Hugging Face's BPE does."""
    ids = [byte_ids[b] for b in chunk]
    if None in ids:
        ids = [i for i in ids if i is not None]
    while len(ids) >= 2:
        ranks = [merges.get(pair) for pair in zip(ids, ids[1:])]
        known = [r for r in ranks if r is not None]
        if not known:
            break
        best = min(known)
        i = ranks.index(best)
        ids = merge_pair(ids, (ids[i], ids[i + 1]), best)
    return ids


class BPETokenizer:
    """Byte-level BPE: a text is pre-split by ``pattern``, each chunk becomes its UTF-8 bytes (one id
    per byte, ``byte_ids[b]``), and adjacent ids are merged greedily, lowest merge rank first.
    A vocabulary may lack some bytes (``byte_ids[b] is None``; SmolLM2's lacks 21 that are rare or
    invalid in UTF-8): they are dropped when encoding, as Hugging Face's BPE without an unknown
    token drops them.

    ``merges`` maps a pair of ids to the id it becomes; that id is also the merge's priority (a
    smaller id was learned earlier and is applied first). A trained tokenizer uses ``byte_ids =
    range(256)`` and ids ``256, 257, …`` for its merges; ``from_tiktoken`` uses tiktoken's ranks.
    """

    def __init__(self, merges: Mapping[Pair, int], pattern: str = GPT4_SPLIT_PATTERN,
                 byte_ids: Sequence[int | None] | None = None) -> None:
        self._regex = _compile_pattern(pattern)
        self.pattern: str = pattern
        byte_ids = range(256) if byte_ids is None else byte_ids
        self.vocab: dict[int, bytes] = _build_vocab(merges, byte_ids)
        self.byte_ids: list[int | None] = list(byte_ids)
        self.merges: dict[Pair, int] = dict(sorted(merges.items(), key=lambda kv: kv[1]))
        self._vocab_size = max(self.vocab) + 1
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def train(cls, text: str, vocab_size: int, pattern: str = GPT4_SPLIT_PATTERN) -> "BPETokenizer":
        """Learn ``vocab_size - 256`` merges from ``text`` (fewer if the text runs out of pairs)."""
        if not _is_int(vocab_size) or vocab_size < 256:
            raise ValueError(f"vocab_size must be an int >= 256 (one token per byte, then the "
                             f"merges), got {vocab_size!r}")
        result = learn_merges(chunk_counts(text, pattern), vocab_size - 256)
        return cls({pair: 256 + k for k, pair in enumerate(result.merges)}, pattern)

    @property
    def vocab_size(self) -> int:
        """Size of the id space (largest id + 1): the rows an embedding table needs."""
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; special-looking strings such as <|endoftext|> are plain
        text."""
        _check_text(text)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: replaced, as tiktoken does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        cache = self._cache
        if len(cache) > _CACHE_LIMIT:
            cache.clear()
        out: list[int] = []
        for chunk in self._regex.findall(text):
            if chunk not in cache:
                cache[chunk] = encode_chunk(chunk.encode(), self.byte_ids, self.merges)
            out.extend(cache[chunk])
        return out

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The raw bytes of a list (or 1-D tensor) of ids."""
        return b"".join(self.vocab[i] for i in _as_id_list(ids, self.vocab_size, self.vocab))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of a list of ids; bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def save(self, path: str | Path) -> Path:
        """Write the tokenizer as JSON (pattern, byte ids, merges); returns the path."""
        payload = {"format": _FORMAT, "version": _FORMAT_VERSION, "pattern": self.pattern,
                   "byte_ids": self.byte_ids,
                   "merges": [[a, b, i] for (a, b), i in self.merges.items()]}
        Path(path).write_text(json.dumps(payload, separators=(",", ":")), encoding="utf-8")
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> "BPETokenizer":
        """Read a tokenizer written by :meth:`save`."""
        try:
            payload = json.loads(Path(path).read_text(encoding="utf-8"))
            found = (payload.get("format"), payload.get("version"))
            if found != (_FORMAT, _FORMAT_VERSION):
                raise ValueError(f"format and version {found}, expected {(_FORMAT, _FORMAT_VERSION)}")
            merges = {(int(a), int(b)): int(i) for a, b, i in payload["merges"]}
            return cls(merges, payload["pattern"], payload["byte_ids"])
        except (AttributeError, KeyError, TypeError, ValueError) as exc:  # bad JSON: a ValueError
            raise ValueError(f"{path} is not a tokenizer written by BPETokenizer.save: {exc}") from exc

    @classmethod
    def from_tiktoken(cls, name: str = "cl100k_base") -> "BPETokenizer":
        """A tiktoken encoding (e.g. ``cl100k_base``) as a BPETokenizer, same ids.

        tiktoken stores ranks (token bytes -> id), not merges. The pair that forms a
        token is found by running BPE on the token's own bytes with only lower-ranked
        tokens allowed: exactly two parts remain, and the token is their merge.
        """
        enc = tiktoken_encoding(name)
        ranks: dict[bytes, int] = enc._mergeable_ranks
        merges: dict[Pair, int] = {}
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            if len(token) > 1:
                first, second = _rank_bpe(ranks, token, max_rank=rank)  # exactly two
                merges[(ranks[first], ranks[second])] = rank
        return cls(merges, enc._pat_str, [ranks[bytes([b])] for b in range(256)])

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)})"


def _rank_bpe(ranks: Mapping[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's merge rule on ``token``'s bytes, using only tokens ranked below ``max_rank``."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_i, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best_i, best_rank = i, r
        if best_i < 0:
            break
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def tiktoken_encoding(name: str = "cl100k_base") -> Any:
    """``tiktoken.get_encoding(name)`` with a clear message when it cannot be loaded offline.

    tiktoken reads its files from the folder named by ``TIKTOKEN_CACHE_DIR`` when they are there and
    downloads them otherwise.
    """
    import tiktoken

    if name not in tiktoken.list_encoding_names():
        raise ValueError(f"name must be one of {tiktoken.list_encoding_names()}, got {name!r}")
    try:
        return tiktoken.get_encoding(name)
    except Exception as exc:  # network errors come in several types
        # Summarise the cause in one line; the chained requests/urllib3/socket traceback (about 50
        # lines) would only bury the message, so it is suppressed.
        cause = " ".join(f"{type(exc).__name__}: {exc}".split())
        cause = cause if len(cause) <= 160 else cause[:157] + "..."
        import os

        cache = os.environ.get("TIKTOKEN_CACHE_DIR")
        where = (f"TIKTOKEN_CACHE_DIR is {cache}, which does not hold it" if cache
                 else "TIKTOKEN_CACHE_DIR is not set")
        raise RuntimeError(f"could not load the tiktoken encoding {name!r} ({cause}). {where}; offline, "
                           f"point TIKTOKEN_CACHE_DIR at a folder that holds it") from None



# --------------------------------------------------------------------------------------------------
# Special tokens and chat templates (models such as SmolLM2)
# --------------------------------------------------------------------------------------------------

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, as vocabularies in tokenizer.json and GGUF
    files store tokens: printable bytes stand for themselves, the others (space, control
    characters, ...) are shifted to 256 and up, so that a space is ``'Ġ'`` and ``'\\n'`` is ``'Ċ'``."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    mapping = {b: chr(b) for b in printable}
    mapping.update({b: chr(256 + n) for n, b in enumerate(others)})
    return mapping


# transformers' markers around a special token's text written inside a message (characters of a
# private-use plane): a marked one is spelled out as ordinary text, never turned into its id.
_MARK_START, _MARK_END = "\U000f0000", "\U000f0001"
_PROBE = "\U000f0002"  # an assistant message's text, to see what the template writes after it


def compile_chat_template(source: str) -> Any:
    """A chat template compiled as ``transformers`` compiles one: in Jinja's sandbox, with
    ``trim_blocks`` and ``lstrip_blocks`` (a block tag's own line break and indentation are not
    output), ``{% break %}`` and ``{% continue %}``, ``{% generation %}`` blocks (TRL's marks around
    assistant text; the body renders as it is), ``raise_exception(message)``, ``strftime_now(format)``
    and a ``tojson`` filter that writes non-ASCII characters and ``<>&'`` as they are."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> list:
            next(parser.stream)  # the tag's name
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, Generation])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


def _checked_messages(messages: Any) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        raise ValueError("messages must be a list of {'role': str, 'content': str} dicts")
    return [dict(m) for m in messages]


class ChatTokenizer:
    """A :class:`BPETokenizer` plus special tokens and a chat template, as chat models ship.

    ``special`` maps each special token's text (``'<|im_start|>'``) to its id. :meth:`encode` cuts
    them out of text you trust (a rendered template) and encodes the rest with ``bpe``;
    :meth:`encode_ordinary` encodes text you do not trust, in which they are ordinary text.
    ``chat_template`` (Jinja) renders as in ``transformers`` (:func:`compile_chat_template`;
    ``bos_token``/``eos_token`` are the texts of ``bos_id``/``eos_id``), and :meth:`encode_chat`
    spells out special tokens' text inside messages. ``end_of_turn_id`` is the special token the
    template writes after an assistant message (``<|im_end|>`` in ChatML; else ``eos_id``): answers
    end there, whatever the file's ``eos_id`` (a base model's is ``<|endoftext|>``).
    """

    def __init__(self, bpe: BPETokenizer, special: Mapping[str, int],
                 chat_template: str | None = None, eos_id: int | None = None,
                 bos_id: int | None = None) -> None:
        if not isinstance(bpe, BPETokenizer) or not isinstance(chat_template, (str, type(None))):
            raise TypeError(f"bpe must be a BPETokenizer and chat_template None or a str (Jinja), "
                            f"got {type(bpe).__name__} and {type(chat_template).__name__}")
        ok = isinstance(special, Mapping) and all(
            isinstance(t, str) and t and _is_int(i) and i >= 0 for t, i in special.items())
        if not ok or len(set(special.values())) != len(special) or any(
                i in bpe.vocab for i in special.values()):
            raise ValueError(f"special must map non-empty token texts to distinct int ids >= 0 "
                             f"that bpe does not use, got {special!r}")
        self.bpe, self.special = bpe, dict(special)
        self.special_text = {i: t.encode("utf-8") for t, i in special.items()}
        if not all(i is None or (_is_int(i) and (i in bpe.vocab or i in self.special_text))
                   for i in (eos_id, bos_id)):
            raise ValueError(f"eos_id and bos_id must be None or ids in the vocabulary, got "
                             f"{eos_id!r} and {bos_id!r}")
        self.chat_template, self.eos_id, self.bos_id = chat_template, eos_id, bos_id
        tokens = "|".join(map(regex.escape, sorted(special, key=len, reverse=True))) or "(?!)"
        self._special_re = regex.compile(f"({tokens})")
        # In a rendered chat: a special token's text that was inside a message (marked, group 1),
        # one the template wrote (group 2), or a marker left alone by the template's string methods.
        self._marked_re = regex.compile(f"{_MARK_START}({tokens}){_MARK_END}|({tokens})"
                                        f"|[{_MARK_START}{_MARK_END}]")
        self._template = None if chat_template is None else compile_chat_template(chat_template)
        self.end_of_turn_id: int | None = _end_of_turn_id(self)

    @property
    def vocab_size(self) -> int:
        """Size of the id space: ``bpe``'s ids and the special ones."""
        return max(self.bpe.vocab_size, max(self.special_text, default=-1) + 1)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; special tokens written in it become their single ids."""
        out: list[int] = []
        for k, piece in enumerate(self._special_re.split(_check_text(text))):
            if k % 2:  # split() puts the matched special tokens at odd positions
                out.append(self.special[piece])
            elif piece:
                out.extend(self.bpe.encode(piece))
        return out

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of untrusted ``text``: a special token's text in it is encoded as ordinary text
        (``<|im_end|>`` as ``<``, ``|``, ``im``, ...), never as the special token."""
        return self.bpe.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens included; invalid UTF-8 becomes U+FFFD."""
        ids = _as_id_list(ids, self.vocab_size)
        text = self.special_text
        parts = [text[i] if i in text else self.bpe.decode_bytes([i]) for i in ids]
        return b"".join(parts).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The conversation as the model was trained to read it, e.g. ChatML:
        ``<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n``."""
        return self._render(messages, add_generation_prompt, mark=False)

    def encode_chat(self, messages: Sequence[Mapping[str, str]],
                    add_generation_prompt: bool = True) -> list[int]:
        """Ids of :meth:`apply_chat_template`, a special token's text inside a message spelled
        out (on its own, as ``transformers``' ``sanitize_control_tokens=True`` does it)."""
        return _encode_rendered(self, self._render(messages, add_generation_prompt))[0]

    def encode_with_assistant_mask(self, messages: Sequence[Mapping[str, str]]
                                   ) -> tuple[list[int], list[bool]]:
        """The ids of a whole conversation (:meth:`encode_chat`, no generation prompt) and, for
        each, whether it is in an assistant turn: from where the conversation before the turn
        ends when rendered with the generation prompt, to the end-of-turn token (the template
        must render a conversation's beginning the same whatever follows, as ChatML does)."""
        messages = _checked_messages(messages)
        whole = self._render(messages, False)
        turns = [_assistant_turn(self, messages, k, whole) for k, m in enumerate(messages)
                 if m["role"] == "assistant"]
        ids, spans = _encode_rendered(self, whole)
        return ids, [any(a < end and b > start for start, end in turns) for a, b in spans]

    def _render(self, messages: Any, add_generation_prompt: bool, mark: bool = True) -> str:
        """The template's text for ``messages``; with ``mark``, a special token's text inside
        a message is wrapped in the markers (any already there are dropped)."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat_template")
        messages = _checked_messages(messages)
        if mark:
            messages = [{key: _mark(value, self._special_re) for key, value in m.items()}
                        for m in messages]
        named = {name: self.decode([i]) for name, i in (("bos_token", self.bos_id),
                                                       ("eos_token", self.eos_id)) if i is not None}
        return self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=bool(add_generation_prompt), **named)

    def __repr__(self) -> str:
        return (f"ChatTokenizer(vocab_size={self.vocab_size}, merges={len(self.bpe.merges)}, "
                f"special={len(self.special)})")


# The chat pieces behind ChatTokenizer's methods.

def _mark(value: Any, special_re: regex.Pattern) -> Any:
    """A message's string with each special token's text in it wrapped in the markers (any
    markers already in it dropped first, so that none can be forged); other values as they are."""
    if not isinstance(value, str):
        return value
    value = value.replace(_MARK_START, "").replace(_MARK_END, "")
    return special_re.sub(lambda m: _MARK_START + m.group() + _MARK_END, value)


def _encode_with_spans(bpe: BPETokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """``bpe.encode(text)`` and, for each id, the characters it covers: ``(start, end)`` such
    that ``text[start:end]`` holds its bytes (a character split over two tokens is in both)."""
    text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")  # as encode does
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for match in bpe._regex.finditer(text):
        chunk, at = match.group(), match.start()
        data = chunk.encode()
        char_of_byte = [k for k, c in enumerate(chunk) for _ in c.encode()]
        kept = [k for k, b in enumerate(data) if bpe.byte_ids[b] is not None]  # bytes with a token
        pos = 0  # the tokens hold the kept bytes in order
        for i in encode_chunk(data, bpe.byte_ids, bpe.merges):
            first, last = kept[pos], kept[pos + len(bpe.vocab[i]) - 1]
            ids.append(i)
            spans.append((at + char_of_byte[first], at + char_of_byte[last] + 1))
            pos += len(bpe.vocab[i])
    return ids, spans


def _encode_rendered(tok: ChatTokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids of a marked rendering (``ChatTokenizer._render``) and the characters each covers:
    the template's special tokens become their ids, the marked ones are spelled out on their
    own, and the text between them is encoded by ``tok.bpe``."""
    ids: list[int] = []
    spans: list[tuple[int, int]] = []

    def add(piece: str, at: int) -> None:
        piece_ids, piece_spans = _encode_with_spans(tok.bpe, piece)
        ids.extend(piece_ids)
        spans.extend((at + a, at + b) for a, b in piece_spans)

    pos = 0
    for match in tok._marked_re.finditer(text):
        add(text[pos:match.start()], pos)
        if match.group(1):
            add(match.group(1), match.start(1))
        elif match.group(2):
            ids.append(tok.special[match.group(2)])
            spans.append(match.span())
        pos = match.end()
    add(text[pos:], pos)
    return ids, spans


def _assistant_turn(tok: ChatTokenizer, messages: list[dict], k: int,
                    whole: str) -> tuple[int, int]:
    """Where assistant message ``k`` and its end-of-turn token lie in ``whole``, the marked
    rendering of ``messages``: from the end of the conversation before it (rendered with the
    generation prompt) to the end of the first end-of-turn token the template writes."""
    head, upto = tok._render(messages[:k], True), tok._render(messages[:k + 1], False)
    ends = [m.end() for m in tok._marked_re.finditer(whole, len(head), len(upto))
            if m.group(2) and tok.special[m.group(2)] == tok.end_of_turn_id]
    if not (whole.startswith(head) and whole.startswith(upto) and ends):
        raise ValueError(f"the chat template must render the conversation before message {k} "
                         f"the same when more follows, and end assistant message {k} with the "
                         f"end-of-turn token (end_of_turn_id={tok.end_of_turn_id})")
    return len(head), ends[0]


def _end_of_turn_id(tok: ChatTokenizer) -> int | None:
    """The first special token ``tok``'s template writes after an assistant message's text;
    ``tok.eos_id`` when it has no template, writes none, or refuses the probe conversation
    (a template may insist on a system message first)."""
    if tok._template is None:
        return tok.eos_id
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}]
    import jinja2  # imported where templates are used, as in compile_chat_template
    try:
        text = tok._render(probe, False)
    except jinja2.TemplateError:
        return tok.eos_id
    after = tok._special_re.search(text, text.rfind(_PROBE) + 1) if _PROBE in text else None
    return tok.special[after.group()] if after else tok.eos_id
