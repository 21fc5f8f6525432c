"""safetensors read by hand (interop/safetensors_files.py) against the safetensors library's own reader
(and torch's bfloat16 for BF16): every dtype, ranged rows and columns, and the refusals."""
import json
import struct

import numpy as np
import pytest

from ringzero.interop.safetensors_files import HFConfigError, TensorFile, widen

st = pytest.importorskip("safetensors.numpy")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_reads_equal_safetensors_own(tmp_path, dtype):
    from safetensors import safe_open
    rng = np.random.default_rng(0)
    t = {"a": rng.standard_normal((7, 5)).astype(dtype), "b": rng.standard_normal(11).astype(dtype),
         "empty": np.zeros((0, 3), dtype)}
    f = str(tmp_path / "x.safetensors")
    st.save_file(t, f, metadata={"format": "pt"})
    with TensorFile(f) as tf, safe_open(f, framework="numpy") as ref:
        assert sorted(tf.keys()) == sorted(ref.keys()) and tf.metadata == {"format": "pt"}
        for k in t:
            a, r = tf.get_slice(k), ref.get_slice(k)
            assert a.get_shape() == r.get_shape() and a.get_dtype() == r.get_dtype()
        a, r = tf.get_slice("a"), ref.get_slice("a")
        for idx in (slice(2, 6), (slice(None), slice(1, 4)), slice(0, 7)):
            got = a[idx]
            assert got.dtype == np.float32 and np.array_equal(got, r[idx].astype(np.float32)), idx
        assert np.array_equal(tf.get_slice("b")[3:9], t["b"][3:9].astype(np.float32))
        assert tf.get_slice("empty")[0:0].shape == (0, 3)


def test_bf16_equals_torch(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file
    x = torch.randn(6, 9, dtype=torch.float32).to(torch.bfloat16)
    x[0, 0], x[0, 1], x[0, 2] = float("inf"), -0.0, 1e-40       # inf, a signed zero, a subnormal
    f = str(tmp_path / "bf.safetensors")
    save_file({"w": x}, f)
    with TensorFile(f) as tf:
        s = tf.get_slice("w")
        assert s.get_dtype() == "BF16" and s.get_shape() == [6, 9]
        ref = x.float().numpy()
        assert np.array_equal(s[0:6].view(np.uint32), ref.view(np.uint32))           # bitwise
        assert np.array_equal(s[:, 2:5].view(np.uint32), ref[:, 2:5].view(np.uint32))
    assert widen(np.array([0x3F80], np.uint16), "BF16")[0] == 1.0


def test_refusals(tmp_path):
    f = tmp_path / "t.safetensors"
    f.write_bytes(b"\x01")
    with pytest.raises(HFConfigError, match="too short for a header"):
        TensorFile(str(f))
    head = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    f.write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 8)          # 8 of 16 data bytes
    with pytest.raises(HFConfigError, match=r"'w' \(F32 \(4,\)\) needs 16 bytes"):
        TensorFile(str(f))
    head = json.dumps({"w": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    f.write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 8)
    with pytest.raises(HFConfigError, match="'w' is I64: expected F32, F16, BF16 or F64"):
        TensorFile(str(f))
