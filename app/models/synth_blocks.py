"""Random tensor data written straight as ggml blocks (f16, q8_0, q4_0, q4_K) plus the small f32 tensors.

Nothing here quantizes floats: each block is random integer codes with one fp16 scale chosen so the decoded
values have the requested standard deviation. The codes are made exactly symmetric around zero, because a
common offset in every row is a rank-one component that grows through the layers until every output is the
same token and every MoE router picks the same experts.

Thread contract: every function is pure given its Generator; callers give each chunk its own Generator, so
chunks can be filled from several threads at once (numpy releases the GIL on these large array operations).
"""

from __future__ import annotations

import math

import numpy as np

# ggml type ids (ggml.h) and the file types llama.cpp records for them (llama.h, llama_ftype).
F32, F16, Q4_0, Q8_0, Q4_K = 0, 1, 2, 8, 12
QTYPES = {"f16": F16, "q8_0": Q8_0, "q4_0": Q4_0, "q4_k": Q4_K}
TYPE_NAMES = {F32: "f32", F16: "f16", Q4_0: "q4_0", Q8_0: "q8_0", Q4_K: "q4_k"}
FILE_TYPE = {F16: 1, Q4_0: 2, Q8_0: 7, Q4_K: 14}
# (values per block, bytes per block)
BLOCK = {F32: (1, 4), F16: (1, 2), Q4_0: (32, 18), Q8_0: (32, 34), Q4_K: (256, 144)}
# A type whose block does not divide a row falls back like llama-quantize does, to a type with smaller blocks.
FALLBACK = {Q4_K: Q4_0, Q4_0: F16, Q8_0: F16, F16: F16}

# Standard deviation of the integer codes as we draw them (see the fill functions):
# q4_0: codes -7..7 with 0 twice as likely (16 nibbles, the -8 one folded onto 0): var = 2*sum(k^2, 1..7)/16.
# q8_0: codes -127..127 with 0 twice as likely: var = 2*sum(k^2, 1..127)/256.
# q4_K: 8*(q - 7.5) for q uniform in 0..15 (sub-block scale 8, min 60*dmin with dmin == d).
# f16: odd int16 values, uniform in -32767..32767, then scaled.
_CODE_STD = {
    Q4_0: math.sqrt(2 * sum(k * k for k in range(1, 8)) / 16),
    Q8_0: math.sqrt(2 * sum(k * k for k in range(1, 128)) / 256),
    Q4_K: 8 * math.sqrt((16 * 16 - 1) / 12),
    F16: math.sqrt((32768.0 ** 2 - 1) / 3),
}
# q4_K sub-block scales and mins (6-bit, packed as in ggml's get_scale_min_k4): all 8 scales 8, all mins 60.
_Q4K_SCALES = np.array([8, 8, 8, 8, 252, 252, 252, 252, 200, 200, 200, 200], dtype=np.uint8)

_ONES_NIBBLE = np.uint64(0x1111111111111111)
_HIGH_BYTE = np.uint64(0x8080808080808080)
_LOW7_BYTE = np.uint64(0x7F7F7F7F7F7F7F7F)
_ODD_I16 = np.uint64(0x0001000100010001)
# random_raw is the fastest source of bits (about 5 GB/s per core; Generator.bytes is 5x slower); pieces of
# 256 KiB keep the bit fixes in L2.
_PIECE_WORDS = 32768


def row_type(qtype: int, ne0: int) -> int:
    """The type a tensor with rows of ne0 values is written in: qtype, or its fallback when blocks don't fit."""
    while ne0 % BLOCK[qtype][0]:
        qtype = FALLBACK[qtype]
    return qtype


def nbytes(qtype: int, n_values: int) -> int:
    per, size = BLOCK[qtype]
    return n_values // per * size


def _make_odd_i16(x: np.ndarray) -> None:
    """In place: every int16 becomes odd, so the values are symmetric around zero (-32767..32767)."""
    x |= _ODD_I16


def _fold_zero_nibbles(x: np.ndarray) -> None:
    """In place: every 4-bit code 0 (value -8) becomes 8 (value 0), so q4_0 codes are symmetric."""
    t = x | (x >> np.uint64(1))
    t |= t >> np.uint64(2)
    t &= _ONES_NIBBLE  # bit 0 of each nibble: was any of its 4 bits set
    t ^= _ONES_NIBBLE
    x |= t << np.uint64(3)


def _fold_min_bytes(x: np.ndarray) -> None:
    """In place: every int8 code -128 (0x80) becomes 0, so q8_0 codes are symmetric."""
    y = x ^ _HIGH_BYTE  # bytes that were 0x80 are now zero
    zero = ~(((y & _LOW7_BYTE) + _LOW7_BYTE) | y | _LOW7_BYTE)  # 0x80 exactly in the zero bytes
    x ^= zero


def _fp16_bytes(value: float) -> np.ndarray:
    return np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)


def code_scale(qtype: int, std: float) -> float:
    """The per-block scale d that makes decoded values have standard deviation `std`."""
    return std / _CODE_STD[qtype]


def _random_codes(qtype: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """`size` random bytes with the type's symmetric-code fix applied, made in L2-sized pieces.

    The fix is several passes of bit operations; done piece by piece they run from cache, about 3x faster
    than over the whole chunk.
    """
    out = np.empty((size + 7) // 8, dtype=np.uint64)
    fix = {Q4_0: _fold_zero_nibbles, Q8_0: _fold_min_bytes, F16: _make_odd_i16}.get(qtype)
    for start in range(0, out.size, _PIECE_WORDS):
        piece = rng.bit_generator.random_raw(min(_PIECE_WORDS, out.size - start))
        if fix is not None:
            fix(piece)
        out[start:start + piece.size] = piece
    return out


def _ints_to_f16(ints: np.ndarray, scale: float) -> np.ndarray:
    """ints * scale as float16, converted piece by piece so the float32 temporaries stay in cache."""
    out = np.empty(ints.size, dtype=np.float16)
    tmp = np.empty(min(ints.size, 4 * _PIECE_WORDS), dtype=np.float32)
    for start in range(0, ints.size, tmp.size):
        n = min(tmp.size, ints.size - start)
        np.multiply(ints[start:start + n], np.float32(scale), out=tmp[:n])
        out[start:start + n] = tmp[:n]
    return out


def fill_blocks(qtype: int, n_values: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """n_values random values of standard deviation `std`, as the bytes of `qtype` blocks (uint8 array)."""
    size = nbytes(qtype, n_values)
    raw = _random_codes(qtype, size, rng)
    if qtype == F16:
        return _ints_to_f16(raw.view(np.int16)[:n_values], code_scale(F16, std)).view(np.uint8)
    blocks = raw.view(np.uint8)[:size].reshape(-1, BLOCK[qtype][1])
    d = _fp16_bytes(code_scale(qtype, std))
    blocks[:, 0] = d[0]  # two single-byte column writes are twice as fast as one 2-byte slice
    blocks[:, 1] = d[1]
    if qtype == Q4_K:
        blocks[:, 2] = d[0]  # dmin == d, so the sub-block min 60*d cancels the mean of 8*d*q exactly
        blocks[:, 3] = d[1]
        blocks[:, 4:16] = _Q4K_SCALES
    return blocks.reshape(-1)


def add_code_noise(qtype: int, data: np.ndarray, sigma: float, rng: np.random.Generator) -> None:
    """In place: add zero-mean noise of sigma times the values' own std to every code (f16: to every value).

    The block scale is left alone: the codes' spread grows by sqrt(1 + sigma^2), a few percent for the sigmas
    that matter. Works piece by piece so the float temporaries stay in cache.
    """
    if sigma <= 0:
        return
    if qtype == F16:
        vals = data.view(np.float16)
        f = vals.astype(np.float32)
        f += rng.standard_normal(f.size, dtype=np.float32) * np.float32(sigma * float(np.std(f)))
        vals[:] = f.astype(np.float16)
        return
    blocks = data.reshape(-1, BLOCK[qtype][1])
    step = max(1, (1 << 16) // BLOCK[qtype][0])
    for start in range(0, blocks.shape[0], step):
        _noise_piece(qtype, blocks[start:start + step], sigma, rng)


def _integer_noise(shape: tuple[int, ...], std: float, rng: np.random.Generator) -> np.ndarray:
    """Zero-mean integer noise with variance std^2, as float32.

    Below one code step, sparse +-1 steps (probability std^2) give the exact variance; rounding a Gaussian
    there would zero almost all of it, and stochastic rounding would add about 0.8*std instead of std^2.
    """
    if std >= 1.0:
        return np.rint(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
    u = rng.random(shape, dtype=np.float32)
    half = np.float32(std * std / 2)
    return (u > 1 - half).astype(np.float32) - (u < half)


def _noise_piece(qtype: int, blocks: np.ndarray, sigma: float, rng: np.random.Generator) -> None:
    head, lo, hi, offset = {Q4_0: (2, -7, 7, 8), Q8_0: (2, -127, 127, 0), Q4_K: (16, 0, 15, 0)}[qtype]
    packed = blocks[:, head:]
    if qtype == Q8_0:
        codes = packed.view(np.int8).astype(np.float32)
        code_std = _CODE_STD[Q8_0]
    else:
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)
        codes -= offset
        code_std = _CODE_STD[Q4_0] if qtype == Q4_0 else _CODE_STD[Q4_K] / 8
    codes += _integer_noise(codes.shape, sigma * code_std, rng)
    np.clip(codes, lo, hi, out=codes)
    if qtype == Q8_0:
        packed[:] = codes.astype(np.int8).view(np.uint8)
        return
    codes += offset
    ints = codes.astype(np.uint8)
    half = ints.shape[1] // 2
    packed[:] = ints[:, :half] | (ints[:, half:] << 4)


def decode_blocks(qtype: int, data: np.ndarray) -> np.ndarray:
    """Float values of blocks written by fill_blocks (tests and the route-skew check use it)."""
    if qtype == F32:
        return data.view(np.float32).astype(np.float32)
    if qtype == F16:
        return data.view(np.float16).astype(np.float32)
    blocks = data.reshape(-1, BLOCK[qtype][1])
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    if qtype == Q8_0:
        return (blocks[:, 2:].view(np.int8).astype(np.float32) * d).reshape(-1)
    head = 2 if qtype == Q4_0 else 16
    packed = blocks[:, head:]
    if qtype == Q4_0:
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32) - 8
        return (codes * d).reshape(-1)
    # q4_K: 4 groups of 64 values; each group's 32 low nibbles, then its 32 high nibbles; scale 8, min 60.
    groups = packed.reshape(-1, 4, 32)
    codes = np.concatenate([groups & 0x0F, groups >> 4], axis=2).astype(np.float32).reshape(-1, 256)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return (codes * 8 * d - 60 * dmin).reshape(-1)
