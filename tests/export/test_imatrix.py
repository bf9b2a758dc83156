"""llama.cpp's importance matrix out (``export/gguf/imatrix.py``): measured from the model's
own block inputs, written in the GGUF layout of llama.cpp's ``tools/imatrix`` (keys,
tensor names and shapes as ``llama-quantize --imatrix`` reads them) and read back."""

from __future__ import annotations

import os
import shutil
import subprocess

import jax
import ml_dtypes
import numpy as np
import pytest

from doc_blocks import marked_blocks, run_block
from microscale.data import ByteTokenizer
from microscale.export.gguf.arch import tensor_name
from microscale.export.gguf.imatrix import read_imatrix, write_imatrix
from microscale.export.gguf.writer import write_gguf
from microscale.ptq.imatrix import collect_imatrix

from .conftest import TINY


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(0)
    return [rng.integers(0, TINY.vocab_size, (2, 33)) for _ in range(3)]


@pytest.fixture(scope="module")
def imatrix(tiny_model, batches):
    return collect_imatrix(tiny_model, batches)


@pytest.fixture(scope="module")
def model_gguf(tmp_path_factory, tiny_model):
    """The model's own GGUF (bf16): the names an imatrix for it must use."""
    path = tmp_path_factory.mktemp("imatrix") / "model.gguf"
    write_gguf(tiny_model, path, layer_formats="bf16", tokenizer=ByteTokenizer())
    return path


def test_block_zero_reads_the_normed_embeddings(tiny_model, batches, imatrix):
    """A plain reference for block 0: its attention input is RMSNorm(embedding) in the
    compute dtype. Each element is within one bfloat16 rounding (2^-8 relative) of the
    reference, so each square within 2^-7, and so is a sum of squares."""
    params = {k: np.asarray(v, np.float32) for k, v in _flat(tiny_model).items()}
    emb, scale = params["embed.embedding"], params["layers.0.attn_norm.scale"]
    sums = 0.0
    for b in batches:
        x = emb[b[:, :-1]].astype(np.float64)
        y = x / np.sqrt((x**2).mean(-1, keepdims=True) + TINY.norm_eps) * scale
        y = y.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
        sums = sums + (y.reshape(-1, TINY.d_model) ** 2).sum(0)
    got = imatrix.in_sum2["layers.0.attn.q_proj"]
    np.testing.assert_allclose(got, sums, rtol=2.0**-7)
    assert imatrix.tokens == 3 * 2 * 32 and imatrix.sequences == 6 and imatrix.seq_len == 32


def test_layers_reading_one_input_have_one_imatrix(imatrix):
    for i in range(TINY.n_layers):
        q = imatrix.in_sum2[f"layers.{i}.attn.q_proj"]
        for other in ("k_proj", "v_proj"):
            np.testing.assert_array_equal(imatrix.in_sum2[f"layers.{i}.attn.{other}"], q)
        gate = imatrix.in_sum2[f"layers.{i}.mlp.gate_proj"]
        np.testing.assert_array_equal(imatrix.in_sum2[f"layers.{i}.mlp.up_proj"], gate)
        assert imatrix.in_sum2[f"layers.{i}.mlp.down_proj"].shape == (TINY.d_ff,)


def test_the_file_is_llama_cpps_layout_named_as_the_model_file(tmp_path, model_gguf, imatrix):
    import gguf

    path = tmp_path / "imatrix.gguf"
    write_imatrix(path, imatrix, datasets=["words.txt"])
    r = gguf.GGUFReader(path)
    by_name = {f"{tensor_name(p)}.weight": v for p, v in imatrix.in_sum2.items()}
    keys = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert keys == {
        "general.type": "imatrix",
        "imatrix.datasets": ["words.txt"],
        "imatrix.chunk_count": 6,
        "imatrix.chunk_size": 32,
    }
    # One pair per linear weight of the model's own GGUF, in name order.
    weights = sorted(
        t.name
        for t in gguf.GGUFReader(model_gguf).tensors
        if t.name.startswith("blk.") and t.name.endswith(".weight") and t.data.ndim == 2
    )
    assert [t.name for t in r.tensors] == [
        f"{w}{s}" for w in weights for s in (".in_sum2", ".counts")
    ]
    for t in r.tensors:  # ggml's ne: in_sum2 (K, n_mat), counts (1, n_mat)
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        k = by_name[t.name.rsplit(".", 1)[0]].size
        assert t.shape.tolist() == ([k, 1] if t.name.endswith(".in_sum2") else [1, 1])
    back = read_imatrix(path)
    assert sorted(by_name) == weights
    assert sorted(back) == weights
    for w in weights:
        want = by_name[w].astype(np.float32) / np.float32(imatrix.tokens)
        np.testing.assert_allclose(back[w], want, rtol=2.0**-23)
    assert {f"{tensor_name(p)}.weight" for p in imatrix.mean_sq()} == back.keys()


def test_what_is_not_an_imatrix_is_refused_by_name(tmp_path, tiny_model, model_gguf):
    with pytest.raises(ValueError, match=r"model\.gguf'.*general.type is None.*a model GGUF"):
        read_imatrix(model_gguf)
    (tmp_path / "notes.txt").write_text("not a gguf")
    with pytest.raises(ValueError, match=r"notes\.txt'.*not a GGUF file"):
        read_imatrix(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match=r"no calibration batches"):
        collect_imatrix(tiny_model, [])
    with pytest.raises(ValueError, match=r"shape \(5,\); expected \[B, T >= 2\]"):
        collect_imatrix(tiny_model, [np.zeros(5, np.int32)])


def _flat(model) -> dict[str, jax.Array]:
    from flax import nnx

    return {
        ".".join(map(str, k)): v[...] for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def test_the_docs_example_runs_as_written(tmp_path, monkeypatch):
    assert set(marked_blocks("llamacpp.md")) == {"imatrix"}
    monkeypatch.chdir(tmp_path)
    _, shown = run_block("llamacpp.md", "imatrix")
    assert shown.strip().splitlines()[-1] == "14 (64,)"
    assert (tmp_path / "imatrix.gguf").is_file() and (tmp_path / "model-bf16.gguf").is_file()


def _llama_quantize() -> str | None:
    """llama.cpp's quantizer: ``MICROSCALE_LLAMA_QUANTIZE`` or ``llama-quantize`` on PATH."""
    return os.environ.get("MICROSCALE_LLAMA_QUANTIZE") or shutil.which("llama-quantize")


@pytest.mark.skipif(
    _llama_quantize() is None,
    reason="no llama-quantize (build llama.cpp's tools/quantize; MICROSCALE_LLAMA_QUANTIZE=path)",
)
def test_llama_quantize_reads_it_and_weights_by_it(tmp_path, model_gguf, imatrix):
    """llama.cpp's own quantizer loads the file (every entry, by name) and its Q4_0 codes
    move with it: the same model quantized with and without it differs."""
    write_imatrix(tmp_path / "imatrix.gguf", imatrix, datasets=["words.txt"])
    tool = _llama_quantize()

    def run(*extra: str) -> tuple[bytes, str]:
        out = tmp_path / f"q4_0{len(extra)}.gguf"
        done = subprocess.run(
            [tool, *extra, str(model_gguf), str(out), "Q4_0"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return out.read_bytes(), done.stdout + done.stderr

    plain, _ = run()
    weighted, log = run("--imatrix", str(tmp_path / "imatrix.gguf"))
    n = len(imatrix.in_sum2)
    assert f"loaded {n} importance matrix entries" in log, log
    assert "computed on 6 chunks" in log, log
    assert weighted != plain
