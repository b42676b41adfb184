"""GGUF files, read from scratch: the container llama.cpp uses for quantised models.

A GGUF file is four parts, in this order (all numbers little-endian):

1. a header: the magic ``b"GGUF"``, a version (2 or 3), the number of tensors and of
   metadata entries (64-bit each);
2. the metadata: key/value pairs (``"llama.block_count" -> 30``,
   ``"tokenizer.ggml.tokens" -> [...]``), each value tagged with one of thirteen types
   (ints, floats, bool, string, array);
3. the tensor table: per tensor its name, its dimensions (innermost first, the reverse
   of torch's order), its storage type (F32, F16, Q8_0, Q4_1, ...) and its offset inside
   the data section;
4. the data section, starting at the first multiple of ``general.alignment`` (default
   32) after the table.

Quantised types store weights in blocks. llama.cpp's legacy types (Q8_0, Q4_0, Q4_1)
use blocks of 32 (``QK``): one float16 scale ``d`` (and, for Q4_1, a float16 minimum
``m``) followed by 32 small integer codes. A weight is ``d * q`` (Q8_0, 8-bit codes ``q``
in -128..127), ``d * (q - 8)`` (Q4_0) or ``d * q + m`` (Q4_1), with 4-bit codes ``q`` in
0..15 packed two to a byte: the low nibbles hold weights 0-15 of the block, the high
nibbles 16-31.

The k-quants (Q2_K to Q6_K; a "Q4_K_M" file mostly mixes Q4_K and Q6_K) use
super-blocks of 256 (``QK_K``) weights: one or two float16 numbers for the whole
super-block, and per sub-block of 16 or 32 weights a scale (and a minimum) stored as a
small integer code of 4 to 8 bits. A weight is ``d * sc * q - dmin * m`` (Q2_K, Q4_K,
Q5_K) or ``d * sc * q`` with signed ``sc`` and ``q`` (Q3_K, Q6_K), its code ``q`` of 2
to 6 bits packed bit plane by bit plane (:func:`unpack_scales_mins` shows how Q4_K and
Q5_K pack their 6-bit scales and mins).

- :func:`read_gguf` reads parts 1-3 into a :class:`GGUFFile` (metadata and tensor table,
  checked);
- :func:`load_gguf` reads a file once: the same, plus every tensor dequantised to float32,
  keyed by its GGUF name;
- :func:`dequantize`, :func:`quantize` turn raw blocks into float32 weights and back.

Results equal the ``gguf`` package's ``gguf.quants.dequantize`` / ``quantize`` bit for
bit (the tests check it). Anything malformed raises :class:`GGUFError` (a ValueError)
naming what is wrong before any tensor is built.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lib.checks import torch_threads

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
QK = 32  # weights per block of the legacy types
QK_K = 256  # weights per super-block of the k-quants

# ggml's storage types lib reads: type id -> (name, weights per block, bytes per block).
GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", QK, 2 + QK // 2),
    3: ("Q4_1", QK, 4 + QK // 2),
    8: ("Q8_0", QK, 2 + QK),
    10: ("Q2_K", QK_K, 84),  # 16 scale/min bytes, 64 bytes of 2-bit codes, d, dmin
    11: ("Q3_K", QK_K, 110),  # 32 high-bit bytes, 64 of 2-bit codes, 12 scale bytes, d
    12: ("Q4_K", QK_K, 144),  # d, dmin, 12 scale/min bytes, 128 bytes of 4-bit codes
    13: ("Q5_K", QK_K, 176),  # d, dmin, 12 scale/min bytes, 32 high-bit bytes, 128 low
    14: ("Q6_K", QK_K, 210),  # 128 bytes of low 4 bits, 64 of high 2 bits, 16 scales, d
}
TYPE_IDS = {name: type_id for type_id, (name, _, _) in GGML_TYPES.items()}
# Names of ggml's other types, only for error messages (lib does not read them).
_OTHER_TYPES = {
    6: "Q5_0",
    7: "Q5_1",
    15: "Q8_K",
    30: "BF16",
}

# Metadata value types: id -> struct format of one scalar; 7 is bool, 8 string, 9 array.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file that lib cannot read: truncated, corrupt, or using a type lib does
    not know."""


@dataclass(frozen=True)
class TensorInfo:
    """One row of the tensor table. ``shape`` is in torch order (outermost first);
    ``offset`` is absolute (from the start of the file); ``n_bytes`` is what the tensor
    occupies."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    offset: int
    n_bytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GGUFFile:
    """What :func:`read_gguf` finds: version, metadata and the tensor table of a GGUF
    file."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int
    file_size: int


# --------------------------------------------------------------------------------------
# Reading the container
# --------------------------------------------------------------------------------------


class _Cursor:
    """Reads little-endian values from ``buf`` left to right; running off the end is a
    GGUFError."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(
                f"{self.path}: truncated or corrupt: {what} needs {n} bytes at byte "
                f"{self.pos}, but the file has {len(self.buf)} bytes"
            )
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        raw = self.take(self.scalar("Q", what + " (length)"), what)
        return bytes(raw).decode("utf-8")

    def value(self, type_id: int, what: str) -> Any:
        if type_id in _SCALARS:
            return self.scalar(_SCALARS[type_id], what)
        if type_id == _STRING:
            return self.string(what)
        if type_id == _ARRAY:
            return self.array(what)
        raise GGUFError(
            f"{self.path}: corrupt: {what} has unknown value type {type_id} "
            f"(GGUF knows 0-12)"
        )

    def array(self, what: str) -> list:
        item_type, count = self.scalar("I", what), self.scalar("Q", what)
        if item_type in _SCALARS:  # numbers: one unpack for the whole array
            fmt = _SCALARS[item_type]
            raw = self.take(count * struct.calcsize(fmt), what)
            return list(struct.unpack(f"<{count}{fmt}", raw))
        return [self.value(item_type, f"{what}[{i}]") for i in range(count)]


def _header(cur: _Cursor) -> tuple[int, int, int]:
    """Magic, version, tensor count and metadata count."""
    magic = bytes(cur.take(4, "the magic number"))
    if magic != MAGIC:
        raise GGUFError(
            f"{cur.path}: not a GGUF file (starts with {magic!r}, not {MAGIC!r})"
        )
    version = cur.scalar("I", "the version")
    if version not in VERSIONS:
        hint = " (a big-endian file?)" if version >= 1 << 16 else ""
        raise GGUFError(
            f"{cur.path}: GGUF version {version}{hint}; lib reads versions {VERSIONS}"
        )
    return (
        version,
        cur.scalar("Q", "the tensor count"),
        cur.scalar("Q", "the metadata count"),
    )


def _tensor_row(cur: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    """One tensor-table row: name, torch-order shape, type id, offset in the data
    section."""
    name = cur.string(f"the name of tensor {index}")
    n_dims = cur.scalar("I", f"the rank of tensor {name!r}")
    dims = [
        cur.scalar("Q", f"the dimensions of tensor {name!r}") for _ in range(n_dims)
    ]
    type_id = cur.scalar("I", f"the type of tensor {name!r}")
    offset = cur.scalar("Q", f"the offset of tensor {name!r}")
    return name, tuple(reversed(dims)), type_id, offset


def _tensor_info(path: Path, row: tuple, data_offset: int) -> TensorInfo:
    """Check a table row's type, shape and offset, and say where its bytes are."""
    name, shape, type_id, offset = row
    if type_id not in GGML_TYPES:
        known = _OTHER_TYPES.get(type_id, "an unknown type")
        raise GGUFError(
            f"{path}: tensor {name!r} is stored as type {type_id} ({known}); lib "
            f"reads {sorted(TYPE_IDS)}"
        )
    type_name, block, block_bytes = GGML_TYPES[type_id]
    if shape[-1] % block:
        raise GGUFError(
            f"{path}: corrupt: tensor {name!r} ({type_name}) has rows of {shape[-1]} "
            f"weights, not a multiple of its block size {block}"
        )
    n_bytes = math.prod(shape) // block * block_bytes
    return TensorInfo(name, shape, type_name, data_offset + offset, n_bytes)


def _check_layout(gf: GGUFFile) -> None:
    """Every tensor lies inside the file."""
    for info in gf.tensors.values():
        end = info.offset + info.n_bytes
        if end > gf.file_size:
            raise GGUFError(
                f"{gf.path}: truncated: tensor {info.name!r} ends at byte {end}, but "
                f"the file has {gf.file_size} bytes"
            )


def _parse(buf: memoryview, path: Path) -> GGUFFile:
    cur = _Cursor(buf, path)
    version, n_tensors, n_meta = _header(cur)
    metadata: dict[str, Any] = {}
    for i in range(n_meta):
        key = cur.string(f"metadata key {i}")
        metadata[key] = cur.value(
            cur.scalar("I", f"the type of {key!r}"), f"metadata {key!r}"
        )
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(
            f"{path}: corrupt: general.alignment = {alignment!r} is not a power of 2"
        )
    rows = [_tensor_row(cur, i) for i in range(n_tensors)]
    data_offset = -(-cur.pos // alignment) * alignment  # round up to the alignment
    tensors = {row[0]: _tensor_info(path, row, data_offset) for row in rows}
    gf = GGUFFile(path, version, metadata, tensors, alignment, data_offset, len(buf))
    _check_layout(gf)
    return gf


def read_gguf(path: str | Path) -> GGUFFile:
    """The header, metadata and tensor table of a GGUF file, checked (no tensor data is
    read)."""
    path = Path(path)
    return _parse(memoryview(path.read_bytes()), path)


# --------------------------------------------------------------------------------------
# Dequantisation and quantisation (one block per row: (n_blocks, bytes per block) uint8)
# --------------------------------------------------------------------------------------


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Two bytes per row -> that float16 as float32: (n, 2) uint8 -> (n, 1)."""
    return raw.contiguous().view(torch.float16).float()


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of ``bits`` bits packed bit plane by bit plane: (..., L) bytes -> (..., 8 /
    bits * L) codes. The lowest ``bits`` bits of the L bytes come first, then the next
    ``bits`` bits of the same bytes, and so on (for 4 bits: low nibbles, then high)."""
    mask = (1 << bits) - 1
    return torch.cat([(packed >> shift) & mask for shift in range(0, 8, bits)], dim=-1)


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (n, 34) -> weights (n, 32): ``d * q``, 8-bit signed codes ``q``
    (one of llama.cpp's legacy types)."""
    d = _f16(blocks[:, :2])  # (n, 1)
    q = blocks[:, 2:].contiguous().view(torch.int8).float()  # (n, 32) in -128..127
    return q * d


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks (n, 18) -> weights (n, 32): ``d * (q - 8)``, 4-bit codes ``q`` (one
    of llama.cpp's legacy types)."""
    d = _f16(blocks[:, :2])
    q = _unpack(blocks[:, 2:], 4).float() - 8  # (n, 32) in -8..7
    return d * q


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks (n, 20) -> weights (n, 32): ``d * q + m`` with 4-bit codes ``q`` (one
    of llama.cpp's legacy types)."""
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])  # scale and minimum, (n, 1) each
    q = _unpack(blocks[:, 4:], 4).float()  # (n, 32) in 0..15
    return d * q + m


def unpack_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 scales and 8 mins of a Q4_K or Q5_K super-block, 6 bits each, from the 12
    bytes they are packed into (llama.cpp's ``get_scale_min_k4``): (n, 12) uint8 -> two
    (n, 8) tensors of codes 0..63.

    16 codes of 6 bits are 96 bits, exactly 12 bytes. Scales 0-3 fill the low 6 bits of
    bytes 0-3 and mins 0-3 those of bytes 4-7. Scales and mins 4-7 are split: their low
    4 bits are the low and high nibbles of bytes 8-11, their top 2 bits the two bits
    left over at the top of bytes 0-3 (scales) and 4-7 (mins). Bit 7 on the left::

        bytes 0-3    s4..s7 bits 5-4 | s0..s3
        bytes 4-7    m4..m7 bits 5-4 | m0..m3
        bytes 8-11   m4..m7 bits 3-0 | s4..s7 bits 3-0
    """
    s, m, low = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([s & 63, (low & 15) | (s >> 6) << 4], dim=1)
    mins = torch.cat([m & 63, (low >> 4) | (m >> 6) << 4], dim=1)
    return scales, mins


def dequantize_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q2_K super-blocks (n, 84) -> weights (n, 256): 16 sub-blocks of 16 weights, each
    ``d * sc * q - dmin * m`` with 2-bit codes ``q`` and 4-bit ``sc`` (low nibble) and
    ``m`` (high nibble) in one byte per sub-block."""
    sc_m, d, dmin = blocks[:, :16], _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    q = _unpack(blocks[:, 16:80].reshape(-1, 2, 32), 2).reshape(-1, 16, 16)
    scale, low = (d * (sc_m & 15)).unsqueeze(2), (dmin * (sc_m >> 4)).unsqueeze(2)
    return (scale * q - low).reshape(-1, QK_K)


def dequantize_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K super-blocks (n, 110) -> weights (n, 256): 16 sub-blocks of 16 weights, each
    ``d * (sc - 32) * (q - 4)``. The 3-bit code ``q`` is 2 low bits plus a high bit kept
    apart (bit k of byte l belongs to weight 32k + l); the 6-bit ``sc`` is a low nibble
    (bytes 96-103) plus 2 high bits (bytes 104-107)."""
    high = _unpack(blocks[:, :32], 1).reshape(-1, 16, 16)
    low = _unpack(blocks[:, 32:96].reshape(-1, 2, 32), 2).reshape(-1, 16, 16)
    sc = _unpack(blocks[:, 96:104], 4) | _unpack(blocks[:, 104:108], 2) << 4  # (n, 16)
    d = _f16(blocks[:, 108:110])
    q = (low | high << 2).float() - 4  # (n, 16, 16) in -4..3
    return ((d * (sc.float() - 32)).unsqueeze(2) * q).reshape(-1, QK_K)


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K super-blocks (n, 144) -> weights (n, 256): 8 sub-blocks of 32 weights, each
    ``d * sc * q - dmin * m`` with 4-bit codes ``q`` and 6-bit ``sc``, ``m``
    (:func:`unpack_scales_mins`). Each 32 bytes of codes hold two sub-blocks: low
    nibbles, then high."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = unpack_scales_mins(blocks[:, 4:16])  # (n, 8) each
    q = _unpack(blocks[:, 16:].reshape(-1, 4, 32), 4).reshape(-1, 8, 32)
    return ((d * sc).unsqueeze(2) * q - (dmin * m).unsqueeze(2)).reshape(-1, QK_K)


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K super-blocks (n, 176) -> weights (n, 256): as Q4_K, with a fifth bit per code
    kept apart (bit k of byte l of bytes 16-47 belongs to weight 32k + l)."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = unpack_scales_mins(blocks[:, 4:16])
    high = _unpack(blocks[:, 16:48], 1).reshape(-1, 8, 32)
    low = _unpack(blocks[:, 48:].reshape(-1, 4, 32), 4).reshape(-1, 8, 32)
    q = low | high << 4  # (n, 8, 32) in 0..31
    return ((d * sc).unsqueeze(2) * q - (dmin * m).unsqueeze(2)).reshape(-1, QK_K)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks (n, 210) -> weights (n, 256): 16 sub-blocks of 16 weights, each
    ``d * sc * (q - 32)`` with 8-bit signed scales ``sc`` and 6-bit codes ``q``. Per half
    of 128 weights, 64 bytes hold the low 4 bits (low nibbles, then high) and 32 bytes
    the top 2 bits (bits 2k+1..2k of byte l belong to weight 32k + l)."""
    low = _unpack(blocks[:, :128].reshape(-1, 2, 64), 4)  # (n, 2, 128)
    high = _unpack(blocks[:, 128:192].reshape(-1, 2, 32), 2)  # (n, 2, 128)
    q = (low | high << 4).float().reshape(-1, 16, 16) - 32  # in -32..31
    sc = blocks[:, 192:208].contiguous().view(torch.int8).float()  # (n, 16)
    d = _f16(blocks[:, 208:210])
    return ((d * sc).unsqueeze(2) * q).reshape(-1, QK_K)


_DEQUANTIZE = {
    "F32": lambda raw: raw.contiguous().view(torch.float32).clone(),
    "F16": lambda raw: raw.contiguous().view(torch.float16).float(),
    "Q8_0": dequantize_q8_0,
    "Q4_0": dequantize_q4_0,
    "Q4_1": dequantize_q4_1,
    "Q2_K": dequantize_q2_k,
    "Q3_K": dequantize_q3_k,
    "Q4_K": dequantize_q4_k,
    "Q5_K": dequantize_q5_k,
    "Q6_K": dequantize_q6_k,
}


def dequantize(
    raw: torch.Tensor, type_name: str, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor's raw bytes (1-D uint8) stored as ``type_name`` (one of ``TYPE_IDS``:
    F32, F16, the legacy Q8_0/Q4_0/Q4_1 and the k-quants Q2_K-Q6_K) -> float32 of
    ``shape``."""
    if type_name not in TYPE_IDS:
        raise ValueError(
            f"type_name must be one of {sorted(TYPE_IDS)}, got {type_name!r}"
        )
    _, _, block_bytes = GGML_TYPES[TYPE_IDS[type_name]]
    weights = _DEQUANTIZE[type_name](raw.view(-1, block_bytes))
    return weights.reshape(shape)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, halves away from zero (C's roundf, as ggml does)."""
    a = x.abs()
    whole = a.floor()
    return x.sign() * (whole + (2 * (a - whole)).floor())


def quantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Weights (n, 32) -> Q8_0 blocks (n, 34): ``d = max|x| / 127``, ``q = round(x /
    d)``."""
    d = blocks.abs().amax(dim=1, keepdim=True) / 127  # (n, 1)
    inv = torch.where(d == 0, 0.0, 1 / d)
    q = _round_half_away(blocks * inv).to(torch.int8)  # (n, 32)
    return torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], dim=1)


def quantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Weights (n, 32) -> Q4_0 blocks (n, 18): the weight of largest magnitude maps to
    code 0 (``d = that weight / -8``), ``q = min(15, floor(x / d + 8.5))``."""
    i = blocks.abs().argmax(dim=1, keepdim=True)
    d = blocks.gather(1, i) / -8  # (n, 1), signed
    inv = torch.where(d == 0, 0.0, 1 / d)
    q = (blocks * inv + 8.5).trunc().to(torch.uint8).clamp(0, 15)  # (n, 32)
    packed = q[:, : QK // 2] | (q[:, QK // 2 :] << 4)  # (n, 16)
    return torch.cat([d.half().view(torch.uint8), packed], dim=1)


_QUANTIZE = {"Q8_0": quantize_q8_0, "Q4_0": quantize_q4_0}


def quantize(weights: torch.Tensor, type_name: str) -> torch.Tensor:
    """float32 weights (last dimension a multiple of 32) -> raw blocks (1-D uint8) of
    ``type_name`` ('Q8_0' or 'Q4_0'), as ggml's reference quantiser writes them."""
    if type_name not in _QUANTIZE:
        raise ValueError(
            f"type_name must be one of {sorted(_QUANTIZE)}, got {type_name!r}"
        )
    if (not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32
            or weights.dim() == 0 or weights.shape[-1] % QK):
        raise ValueError(f"weights must be a float32 tensor whose last dimension is a "
                         f"multiple of {QK}, got {weights!r:.60}")
    return _QUANTIZE[type_name](weights.reshape(-1, QK)).reshape(-1)


# --------------------------------------------------------------------------------------
# Whole files
# --------------------------------------------------------------------------------------


def load_gguf(
    path: str | Path, sha256: str | None = None
) -> tuple[GGUFFile, dict[str, torch.Tensor]]:
    """A GGUF file read once: its header, metadata and tensor table (as :func:`read_gguf`
    gives them) and every tensor dequantised to float32 (torch order of dimensions),
    keyed by its GGUF name.

    With ``sha256`` the checksum of the bytes read is verified first. The whole file is read and
    checked before any tensor is built, so a bad file raises :class:`GGUFError` and
    returns nothing.
    """
    path = Path(path)
    buf = bytearray(path.read_bytes())
    actual = None if sha256 is None else hashlib.sha256(buf).hexdigest()
    if actual is not None and actual != sha256.lower():
        raise GGUFError(f"{path}: wrong checksum: SHA-256 is {actual}, expected {sha256}")
    gf = _parse(memoryview(buf), path)
    data = (
        torch.frombuffer(buf, dtype=torch.uint8)
        if buf
        else torch.empty(0, dtype=torch.uint8)
    )
    # Dequantising is many small memory-bound operations, for which waking a second
    # thread costs more than it saves (ten times more on a busy machine).
    with torch_threads(1):
        weights = {
            name: dequantize(
                data[t.offset : t.offset + t.n_bytes], t.type_name, t.shape
            )
            for name, t in gf.tensors.items()
        }
    return gf, weights
