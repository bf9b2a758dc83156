"""RoPE scaling in GGUF (microscale.export.gguf.rope): llama.cpp's keys and rope_freqs tensor
written, read back by the ``gguf`` package and by microscale, and refused where llama.cpp
cannot compute the kind (skipped without the ``gguf`` package)."""

from __future__ import annotations

import math

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", exc_type=ImportError)

from flax import nnx  # noqa: E402

from microscale.data import ByteTokenizer  # noqa: E402
from microscale.export.gguf.rope import read_gguf_rope  # noqa: E402
from microscale.export.gguf.to_hf import gguf_model_config  # noqa: E402
from microscale.export.gguf.writer import write_gguf  # noqa: E402
from microscale.export.gguffile import open_gguf  # noqa: E402
from microscale.model import ModelConfig, RopeScaling, Transformer  # noqa: E402
from microscale.model.rope import frequency_divisors  # noqa: E402

from .conftest import make_model  # noqa: E402

BASE = ModelConfig(
    vocab_size=257, d_model=128, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=128, max_seq_len=64
)
K = "llama.rope.scaling."


def _llama_cpp_rope_freqs(head_dim, theta, factor, low, high, span) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors), written out
    again: the reference for rope_freqs.weight."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < span / high:
            out.append(1.0)
        elif wavelen > span / low:
            out.append(factor)
        else:
            smooth = (span / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("theta", [500.0, 10000.0, 500000.0])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_llama3_divisors_are_llama_cpps_rope_freqs(head_dim, theta):
    sc = RopeScaling(kind="llama3", factor=8.0, original_max_position_embeddings=8192)
    want = _llama_cpp_rope_freqs(head_dim, theta, 8.0, 1.0, 4.0, 8192)
    got = frequency_divisors(head_dim, theta, sc)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def _write(cfg: ModelConfig, path):
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    write_gguf(model, path, tokenizer=ByteTokenizer(), layer_formats="bf16")
    return gguf.GGUFReader(path)


# (RopeScaling, theta, the llama.cpp keys it must write)
WRITTEN = [
    (None, 10000.0, {}),
    (RopeScaling(kind="linear", factor=4.0), 10000.0, {K + "type": "linear", K + "factor": 4.0}),
    (
        RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=16.0),
        10000.0,
        {
            K + "type": "yarn",
            K + "factor": 4.0,
            K + "original_context_length": 16,
            K + "yarn_beta_fast": 16.0,
            K + "yarn_beta_slow": 1.0,
        },
    ),
    (RopeScaling(kind="llama3", factor=32.0, original_max_position_embeddings=8192), 5e5, {}),
    (
        RopeScaling(
            kind="llama3",
            factor=4.0,
            low_freq_factor=0.5,
            high_freq_factor=2.0,
            original_max_position_embeddings=64,
        ),
        500.0,
        {},
    ),
]


@pytest.mark.parametrize("rope, theta, keys", WRITTEN, ids=lambda x: getattr(x, "kind", None))
def test_gguf_holds_llama_cpps_rope_metadata_and_reads_back(rope, theta, keys, tmp_path):
    cfg = BASE.replace(rope_scaling=rope, rope_theta=theta)
    reader = _write(cfg, tmp_path / "m.gguf")
    found = {k: reader.fields[k].contents() for k in reader.fields if k.startswith(K)}
    assert found == keys
    tensors = {t.name: t for t in reader.tensors}
    if rope is not None and rope.kind == "llama3":
        want = _llama_cpp_rope_freqs(
            cfg.head_dim,
            theta,
            rope.factor,
            rope.low_freq_factor,
            rope.high_freq_factor,
            rope.original_max_position_embeddings,
        )
        got = np.asarray(tensors["rope_freqs.weight"].data, np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    else:
        assert "rope_freqs.weight" not in tensors
    back = gguf_model_config(open_gguf(tmp_path / "m.gguf"))
    assert back.rope_scaling == rope and back.rope_theta == theta


def _llama_cpp_file(path, theta, keys=None, freqs=None):
    """A GGUF with only what llama.cpp's converter writes for RoPE (no microscale key)."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_rope_freq_base(theta)
    for k, v in (keys or {}).items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        else:
            w.add_float32(k, v)
    if freqs is not None:
        w.add_tensor("rope_freqs.weight", freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return open_gguf(path)


@pytest.mark.parametrize(
    "name, head_dim, factor",
    [("llama-3.2-1b", 64, 32.0), ("llama-3.1-8b", 128, 8.0), ("llama-3.1-70b", 128, 8.0)],
)
def test_a_llama_cpp_llama3_file_is_solved_for_its_parameters(name, head_dim, factor, tmp_path):
    freqs = _llama_cpp_rope_freqs(head_dim, 500000.0, factor, 1.0, 4.0, 8192)
    file = _llama_cpp_file(tmp_path / "m.gguf", 500000.0, freqs=freqs)
    cfg = BASE.replace(d_model=head_dim * 2, rope_theta=500000.0)
    assert read_gguf_rope(file, cfg) == RopeScaling(
        kind="llama3", factor=factor, original_max_position_embeddings=8192
    )


@pytest.mark.parametrize(
    "keys, freqs, message",
    [
        ({K + "type": "longrope"}, None, "llama.rope.scaling.type='longrope'"),
        (
            {K + "type": "linear", K + "factor": 2.0},
            np.ones(32, np.float32),
            "rope_freqs.weight with llama.rope.scaling.type='linear'",
        ),
        ({K + "yarn_log_multiplier": 0.1}, None, "llama.rope.scaling.yarn_log_multiplier="),
        ({K + "attn_factor": 2.0}, None, "llama.rope.scaling.attn_factor=2.0"),
        (
            {K + "type": "yarn", K + "factor": 4.0, K + "yarn_attn_factor": 1.0},
            None,
            "llama.rope.scaling.yarn_attn_factor=1.0",
        ),
        ({}, np.ones(32, np.float32), "rope_freqs.weight: no pair between"),
        ({}, np.linspace(1, 3, 32).astype(np.float32), "rope_freqs.weight: not llama3's"),
        (
            {},
            _llama_cpp_rope_freqs(64, 10000.0, 8.0, 1.0, 4.0, 64)
            * np.where(np.arange(32) == 6, np.float32(1.01), np.float32(1.0)),
            "rope_freqs.weight disagrees with the llama3 scaling solved from it",
        ),
    ],
)
def test_llama_cpp_rope_keys_microscale_does_not_compute_are_refused(
    keys, freqs, message, tmp_path
):
    file = _llama_cpp_file(tmp_path / "m.gguf", 10000.0, keys, freqs)
    with pytest.raises(ValueError) as e:
        read_gguf_rope(file, BASE)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "rope, message",
    [
        (
            RopeScaling(kind="dynamic", factor=2.0, original_max_position_embeddings=32),
            "rope_scaling.kind='dynamic': dynamic NTK",
        ),
        (
            RopeScaling(
                kind="yarn", factor=4.0, original_max_position_embeddings=16, attention_factor=1.2
            ),
            "rope_scaling.kind='yarn': attention_factor=1.2",
        ),
        (
            RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0),
            "rope_scaling.kind='yarn': mscale=1.0",
        ),
        (
            RopeScaling(
                kind="yarn", factor=4.0, original_max_position_embeddings=16, truncate=False
            ),
            "truncate=false",
        ),
    ],
)
def test_gguf_export_refuses_what_llama_cpp_cannot_compute_before_writing(rope, message, tmp_path):
    model = make_model()
    path = tmp_path / "m.gguf"
    with pytest.raises(ValueError, match="GGUF export") as e:
        write_gguf(
            model,
            path,
            config=model.config.replace(rope_scaling=rope),
            tokenizer=ByteTokenizer(),
            layer_formats="bf16",
        )
    assert message in str(e.value) and not path.exists()
