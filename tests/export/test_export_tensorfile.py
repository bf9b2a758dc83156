"""safetensors reader/writer: round trip of every dtype, sharding, and rejection of
malformed, truncated or inconsistent files with the tensor named."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from microscale.export.tensorfile import (
    DTYPES,
    INDEX_NAME,
    SafetensorsError,
    TensorStore,
    read_safetensors_header,
    write_safetensors,
    write_sharded,
)


def _tensors():
    rng = np.random.default_rng(0)
    out = {}
    for name, dt in DTYPES.items():
        if name == "BOOL":
            out[name.lower()] = rng.random((3, 5)) > 0.5
        elif np.issubdtype(dt, np.integer):
            out[name.lower()] = rng.integers(0, 100, (3, 5)).astype(dt)
        else:
            # (positive: E8M0 has no sign, a negative would cast to NaN, which reads refuse)
            x = np.abs(rng.standard_normal((3, 5))) + 0.01
            out[name.lower()] = x.astype(np.float32).astype(dt)
    out["scalar"] = np.float32(2.5).reshape(())
    out["empty"] = np.zeros((0, 4), np.float32)
    return out


def test_round_trip_every_dtype(tmp_path):
    t = _tensors()
    write_safetensors(tmp_path / "a.safetensors", t, {"format": "pt"})
    store = TensorStore(tmp_path / "a.safetensors")
    assert sorted(store.names()) == sorted(t)
    assert store.metadata == {"format": "pt"}
    for k, v in t.items():
        got = store.get(k)
        assert got.dtype == v.dtype and got.shape == v.shape
        assert got.tobytes() == np.ascontiguousarray(v).tobytes()


def test_readable_by_the_safetensors_library(tmp_path):
    t = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "u": np.arange(6, dtype=np.uint8)}
    write_safetensors(tmp_path / "a.safetensors", t)
    back = safetensors.numpy.load_file(str(tmp_path / "a.safetensors"))
    for k, v in t.items():
        np.testing.assert_array_equal(back[k], v)
    # and the other way round
    safetensors.numpy.save_file(t, str(tmp_path / "b.safetensors"))
    store = TensorStore(tmp_path / "b.safetensors")
    np.testing.assert_array_equal(store.get("w"), t["w"])


def test_sharding_with_index_keeps_groups_together(tmp_path):
    t = {f"l{i}.{s}": np.full((64,), i, np.float32) for i in range(6) for s in ("a", "b")}
    files = write_sharded(
        tmp_path, t, shard_bytes=600, groups=[[f"l{i}.a", f"l{i}.b"] for i in range(6)]
    )
    assert INDEX_NAME in files and len(files) > 2
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in t.values())
    for i in range(6):
        assert index["weight_map"][f"l{i}.a"] == index["weight_map"][f"l{i}.b"]
    store = TensorStore(tmp_path)
    for k, v in t.items():
        np.testing.assert_array_equal(store.get(k), v)
    # below the threshold: one file, no index
    (tmp_path / "one").mkdir()
    assert write_sharded(tmp_path / "one", t, shard_bytes=10**9) == ["model.safetensors"]


def _raw_file(path, header: dict, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_truncated_file_names_the_tensor(tmp_path):
    write_safetensors(
        tmp_path / "a.safetensors",
        {"first": np.zeros(4, np.float32), "second": np.ones(1000, np.float32)},
    )
    raw = (tmp_path / "a.safetensors").read_bytes()
    (tmp_path / "a.safetensors").write_bytes(raw[:-100])
    with pytest.raises(SafetensorsError, match=r"'second'.*truncated"):
        TensorStore(tmp_path / "a.safetensors")
    (tmp_path / "a.safetensors").write_bytes(raw[:20])
    with pytest.raises(SafetensorsError, match="header length"):
        TensorStore(tmp_path / "a.safetensors")
    (tmp_path / "a.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsError, match="too short"):
        TensorStore(tmp_path / "a.safetensors")


@pytest.mark.parametrize(
    "entry, match",
    [
        ({"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}, "unknown dtype 'F99'"),
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "expected 12"),
        ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "shape"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "data_offsets"),
        ({"dtype": "F32", "shape": [2]}, "keys"),
    ],
)
def test_malformed_header_names_the_tensor(tmp_path, entry, match):
    _raw_file(tmp_path / "a.safetensors", {"bad.weight": entry}, bytes(8))
    with pytest.raises(SafetensorsError, match=match) as e:
        read_safetensors_header(tmp_path / "a.safetensors")
    assert "bad.weight" in str(e.value)


def test_overlapping_tensors_and_non_json_rejected(tmp_path):
    h = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    _raw_file(tmp_path / "a.safetensors", h, bytes(12))
    with pytest.raises(SafetensorsError, match="overlap"):
        read_safetensors_header(tmp_path / "a.safetensors")
    (tmp_path / "b.safetensors").write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{}")
    with pytest.raises(SafetensorsError, match="not UTF-8 JSON"):
        read_safetensors_header(tmp_path / "b.safetensors")


def test_index_inconsistencies(tmp_path):
    write_safetensors(tmp_path / "s1.safetensors", {"a": np.zeros(2, np.float32)})
    index = {"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(SafetensorsError, match=r"'b' is listed .* missing"):
        TensorStore(tmp_path)
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "../s1.safetensors"}}))
    with pytest.raises(SafetensorsError, match="plain file name"):
        TensorStore(tmp_path)
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "nope.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        TensorStore(tmp_path)


def test_float8_bytes_are_the_ml_dtypes_encoding(tmp_path):
    x = np.array([0.0, 1.0, -448.0, 0.015625], np.float32).astype(ml_dtypes.float8_e4m3fn)
    write_safetensors(tmp_path / "a.safetensors", {"s": x})
    info, _ = read_safetensors_header(tmp_path / "a.safetensors")
    assert info["s"].dtype == "F8_E4M3"
    assert TensorStore(tmp_path / "a.safetensors").get("s").view(np.uint8).tolist() == [
        0x00,
        0x38,
        0xFE,
        0x08,
    ]
