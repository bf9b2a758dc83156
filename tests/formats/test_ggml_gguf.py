"""ggml's block types in a GGUF file: written by ``export.gguf.tensors.gguf_ggml_tensor`` through the
``gguf`` package's writer, read back by its reader as the same type and bytes, and decoded
by its dequantizers to what ``formats.ggml`` decodes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import quants

from microscale.export.gguf.tensors import gguf_ggml_tensor
from microscale.formats.ggml import dequantize_ggml, quantize_ggml
from microscale.formats.spec import GGML_FORMATS


def test_written_types_read_back(tmp_path):
    rng = np.random.default_rng(0)
    w = {f: (rng.standard_normal((8, 512)) * 0.02).astype(np.float32) for f in GGML_FORMATS}
    imatrix = (rng.random(512) ** 2).astype(np.float32)
    path = tmp_path / "t.gguf"
    wr = gguf.GGUFWriter(path, "llama")
    stored = {}
    for f, x in w.items():
        arr, qtype = gguf_ggml_tensor(x, f, f"t.{f}", imatrix=imatrix)
        assert qtype == gguf.GGMLQuantizationType[f.upper()]
        np.testing.assert_array_equal(arr, quantize_ggml(x, f, imatrix))
        stored[f] = arr
        wr.add_tensor(f"t.{f}", arr, raw_dtype=qtype)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    rd = gguf.GGUFReader(path)
    assert len(rd.tensors) == len(GGML_FORMATS)
    for t in rd.tensors:
        f = t.name.split(".", 1)[1]
        assert t.tensor_type == gguf.GGMLQuantizationType[f.upper()]
        assert [int(d) for d in t.shape] == [512, 8]  # ggml order: ne0 = K
        data = np.asarray(t.data).reshape(8, -1)
        np.testing.assert_array_equal(data, stored[f])
        ours = dequantize_ggml(data, f, 512)
        ref = quants.dequantize(data, t.tensor_type).reshape(8, 512)
        np.testing.assert_array_equal(ours, ref)
        rel = np.mean((ours - w[f]) ** 2) / np.mean(w[f] ** 2)
        assert rel < 0.2, (f, rel)


def test_refuses_widths_llama_cpp_falls_back_on():
    x = np.zeros((4, 576), np.float32)  # 576 = 18 x 32, not a multiple of 256
    with pytest.raises(ValueError, match="llama.cpp writes such a tensor as q5_0"):
        gguf_ggml_tensor(x, "q4_k", "blk.0.ffn_up")
    arr, _ = gguf_ggml_tensor(x, "q5_0", "blk.0.ffn_up")
    assert arr.shape == (4, 18 * 22)
    with pytest.raises(ValueError, match="non-finite"):
        gguf_ggml_tensor(np.full((1, 256), np.nan, np.float32), "q4_k", "x")
