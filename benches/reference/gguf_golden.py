"""Golden file for ringtmp's GGUF reader: `gguf/quants.gguf`, written by the `gguf` package.

For every tensor type the reader dequantises (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
Q4_K, Q5_K, Q6_K, Q8_K) it holds `q.<TYPE>`, a 2 × 512 tensor in that type, and
`expected.<TYPE>`, the same values dequantised to F32 by `gguf.quants.dequantize` (Q8_K, which
the package does not dequantise, by ggml's `dequantize_row_q8_K`: d · q). The legacy types are
quantised from normal values by `gguf.quants.quantize`; the K-quants, which the package cannot
quantise, are random blocks whose f16/f32 scales are set to finite values. The metadata holds
one key of every GGUF value type, for the parser's test.

    pip install gguf==0.19.0 numpy
    python3 benches/reference/gguf_golden.py
"""

import pathlib

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf import quants

OUT = pathlib.Path(__file__).parent / "gguf" / "quants.gguf"
ROWS, COLS = 2, 512
rng = np.random.default_rng(20261204)


def finite_f16(n):
    return (rng.standard_normal(n) * 0.05).astype(np.float16).view(np.uint8)


def random_blocks(t):
    """Random blocks of K-quant type `t` with finite scales (offsets as in ggml-common.h)."""
    block, size = gguf.GGML_QUANT_SIZES[t]
    n = ROWS * COLS // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    if t in (T.Q4_K, T.Q5_K):  # d, dmin first
        raw[:, 0:4] = finite_f16(2 * n).reshape(n, 4)
    elif t == T.Q6_K:  # d last
        raw[:, size - 2 : size] = finite_f16(n).reshape(n, 2)
    elif t == T.Q8_K:  # f32 d first
        raw[:, 0:4] = (rng.standard_normal(n) * 0.01).astype(np.float32).view(np.uint8).reshape(n, 4)
    return raw.reshape(ROWS, -1)


def q8_k_dequantize(raw):
    blocks = raw.reshape(-1, 292)
    d = blocks[:, 0:4].copy().view(np.float32)
    q = blocks[:, 4:260].copy().view(np.int8).astype(np.float32)
    return (d * q).reshape(ROWS, COLS).astype(np.float32)


def main():
    OUT.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(OUT), arch="ringtmp-test")
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_float32("test.f32", 0.15625)
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_float64("test.f64", -2.5e-300)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "grüße, 世界")
    w.add_array("test.strings", ["a", "", "ccc"])
    w.add_array("test.ints", [1, -2, 3])
    values = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    for t in [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K]:
        if t in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K):
            raw = random_blocks(t)
        elif t == T.F32:
            raw = values
        elif t == T.F16:
            raw = values.astype(np.float16)
        else:
            raw = quants.quantize(values, t)
        expected = q8_k_dequantize(raw) if t == T.Q8_K else quants.dequantize(raw, t)
        assert expected.shape == (ROWS, COLS) and np.isfinite(expected).all(), t
        w.add_tensor(f"q.{t.name}", raw, raw_dtype=t)
        w.add_tensor(f"expected.{t.name}", expected.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
