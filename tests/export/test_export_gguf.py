"""GGUF export, checked by the gguf package's own reader and reference dequantizers.

The layouts (ggml/src/ggml-common.h, ggml-quants.c): NVFP4 = 36 bytes per 64 values (4
UE4M3 scale bytes, then per 16-group 8 bytes with element j low, j+8 high) times the F32
``.scale`` tensor; MXFP4 = 17 bytes per 32 (E8M0 byte, then element j low, j+16 high);
Q8_0 = 34 bytes per 32 (float16 d, 32 int8).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from microscale.data import ByteTokenizer
from microscale.export import flat_params
from microscale.export import layouts as L
from microscale.export.gguf.tensors import GGUF_FORMATS, gguf_format, gguf_tensor
from microscale.export.gguf.writer import write_gguf
from microscale.formats import E2M1_VALUES, dequantize, quantize

from .conftest import TINY, make_model

gguf = pytest.importorskip("gguf")
from gguf import GGUFReader, quants  # noqa: E402

# e2m1 value of each 4-bit code 0..15 (sign bit 3)
CODE_VALUES = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)

ALLOC = {
    f"layers.{i}.{k}": f
    for i in range(2)
    for k, f in (
        ("attn.q_proj", "nvfp4"),
        ("attn.k_proj", "nvfp4"),
        ("attn.v_proj", "nvfp4"),
        ("attn.o_proj", "mxfp4"),
        ("mlp.gate_proj", "q8_0" if i == 0 else "bf16"),
        ("mlp.up_proj", "q8_0" if i == 0 else "bf16"),
        ("mlp.down_proj", "fp8_e4m3" if i == 0 else "mxfp8"),
    )
}


# llama.cpp's Llama tensor names (src/llama-arch.cpp) of microscale's linear layers
GGUF_NAMES = {
    "attn.q_proj": "attn_q",
    "attn.k_proj": "attn_k",
    "attn.v_proj": "attn_v",
    "attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gname(path: str) -> str:
    _, i, kind = path.split(".", 2)
    return f"blk.{i}.{GGUF_NAMES[kind]}"


def _rope_unpermute(w: np.ndarray, head_dim: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation (convert_hf_to_gguf.py ``permute``:
    rows of a head ordered 0, hd/2, 1, hd/2+1, ...)."""
    n = w.shape[0]
    return w.reshape(n // head_dim, head_dim // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = make_model()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    res = write_gguf(model, path, layer_formats=ALLOC, tokenizer=ByteTokenizer())
    return model, path, res


def test_golden_block_bytes():
    # codes 0..15 twice per 32 values: amax 6 puts every scale at 1 (NVFP4: s_dec = 6/2688,
    # block scale 448 = 0x7E; MXFP4: E8M0 2^0 = 127), so the element codes are j % 16.
    row = np.tile(CODE_VALUES, 4)[None]
    nv, t = gguf_tensor(quantize(row, "nvfp4", axis=-1), "x")
    assert t == gguf.GGMLQuantizationType.NVFP4 and nv.shape == (1, 36)
    assert list(nv[0, :4]) == [0x7E] * 4
    assert list(nv[0, 4:]) == [j | (j + 8) << 4 for j in range(8)] * 4
    mx, t = gguf_tensor(quantize(row, "mxfp4", axis=-1), "x")
    assert t == gguf.GGMLQuantizationType.MXFP4 and mx.shape == (1, 34)
    assert list(mx[0, :17]) == [127] + [(j % 16) | (j % 16) << 4 for j in range(16)]


@pytest.mark.parametrize(
    "fmt, expect",
    [
        ("nvfp4", "nvfp4"),
        ("mxfp4", "mxfp4"),
        ("q8_0", "q8_0"),
        ("fp8_e4m3", "q8_0"),
        ("fp8_e5m2", "q8_0"),
        ("mxfp8", "q8_0"),
        ("bf16", "bf16"),
    ],
)
def test_format_mapping(fmt, expect):
    assert gguf_format(fmt) == expect


@pytest.mark.parametrize("fmt", sorted(GGUF_FORMATS))
@pytest.mark.parametrize("seed", [0, 1])
def test_tensor_decodes_bit_exact_with_gguf_reference(fmt, seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(3, (48, 192)) * 0.02).astype(np.float32)
    w[3, :64] = 0  # a zero block
    w[5, 7] = 0.9  # an outlier
    q = quantize(w, fmt, axis=-1)
    blocks, qtype = gguf_tensor(q, "w")
    got = quants.dequantize(blocks, qtype)
    if q.global_scale is not None:
        got = got * np.asarray(q.global_scale, np.float32)
    np.testing.assert_array_equal(got, np.asarray(dequantize(q)))


def test_2d_tiles_are_stored_per_row():
    w = np.random.default_rng(2).standard_normal((40, 128)).astype(np.float32)
    q = quantize(w, "nvfp4", axis=-1, block_shape=(16, 16))  # 40 rows: padded to 48
    blocks, qtype = gguf_tensor(q, "w")
    got = quants.dequantize(blocks, qtype) * np.asarray(q.global_scale, np.float32)
    np.testing.assert_array_equal(got, np.asarray(dequantize(q)))


@pytest.mark.slow
def test_every_linear_tensor_decodes_to_microscale_weights(exported):
    model, path, res = exported
    r = GGUFReader(path)
    tensors = {t.name: t for t in r.tensors}
    params = flat_params(model)
    layers = {p: L.LayerQuant(weights=gguf_format(f)) for p, f in ALLOC.items()}
    qs = L.quantize_linear_weights(params, TINY, layers)
    assert res.layers == {p: lq.weights for p, lq in layers.items()}
    for p, fmt in ALLOC.items():
        kind = p.split(".", 2)[2]
        t = tensors[f"{gname(p)}.weight"]
        got = quants.dequantize(t.data, t.tensor_type)
        if f"{gname(p)}.scale" in tensors:
            got = got * tensors[f"{gname(p)}.scale"].data.astype(np.float32)
        if kind in ("attn.q_proj", "attn.k_proj"):
            got = _rope_unpermute(got, TINY.head_dim)
        master = np.asarray(params[f"{p}.kernel"], np.float32).T
        stored = gguf_format(fmt)
        if stored == "bf16":
            assert t.tensor_type == gguf.GGMLQuantizationType.BF16
            np.testing.assert_array_equal(
                got, np.asarray(jnp.asarray(master, jnp.bfloat16), np.float32)
            )
            continue
        assert t.tensor_type == gguf.GGMLQuantizationType[GGUF_FORMATS[stored]]
        np.testing.assert_array_equal(got, np.asarray(dequantize(qs[p])).T)  # bit-exact
        if fmt != stored:  # FP8 / MXFP8 requantized to Q8_0 from the master weights
            d = np.abs(master).reshape(master.shape[0], -1, 32).max(-1, keepdims=True) / 127
            err = np.abs(got - master).reshape(d.shape[0], -1, 32)
            assert (err <= d * (0.5 + 127 * 2.0**-11) + 1e-12).all()


def test_metadata_and_other_tensors(exported):
    model, path, _ = exported
    r = GGUFReader(path)

    def field(key):
        f = r.fields[key]
        return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]]

    assert field("general.architecture") == "llama"
    for key, want in (
        ("llama.block_count", 2),
        ("llama.embedding_length", 64),
        ("llama.feed_forward_length", 128),
        ("llama.attention.head_count", 4),
        ("llama.attention.head_count_kv", 2),
        ("llama.rope.dimension_count", 16),
        ("llama.context_length", 64),
        ("llama.vocab_size", 257),
    ):
        assert int(field(key)) == want, key
    assert np.isclose(field("llama.rope.freq_base"), TINY.rope_theta)
    assert np.isclose(field("llama.attention.layer_norm_rms_epsilon"), TINY.norm_eps)
    assert field("tokenizer.ggml.model") == "gpt2"
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == 257 and tokens[256] == "<|eos|>" and tokens[ord("a")] == "a"
    assert tokens[ord(" ")] == "\u0120"  # GPT-2's byte-to-unicode character for a space
    assert int(field("tokenizer.ggml.eos_token_id")) == 256
    assert (
        field("tokenizer.ggml.add_bos_token") is False
        or int(field("tokenizer.ggml.add_bos_token")) == 0
    )
    names = {t.name: t for t in r.tensors}
    assert "output.weight" not in names  # tied embeddings: llama.cpp reuses token_embd
    emb = names["token_embd.weight"]
    assert emb.tensor_type == gguf.GGMLQuantizationType.BF16
    params = flat_params(model)
    np.testing.assert_array_equal(
        quants.dequantize(emb.data, emb.tensor_type),
        np.asarray(jnp.asarray(params["embed.embedding"], jnp.bfloat16), np.float32),
    )
    norm = names["blk.1.ffn_norm.weight"]
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32
    np.testing.assert_array_equal(norm.data, np.asarray(params["layers.1.mlp_norm.scale"]))
    assert names["blk.0.attn_q.scale"].tensor_type == gguf.GGMLQuantizationType.F32
    assert "blk.0.attn_output.scale" not in names  # MXFP4 has no tensor scale


def test_untied_lm_head_is_written(tmp_path):
    model = make_model(TINY.replace(tie_embeddings=False))
    path = tmp_path / "m.gguf"
    write_gguf(model, path, layer_formats="q8_0", tokenizer=ByteTokenizer())
    names = {t.name: t for t in GGUFReader(path).tensors}
    out = names["output.weight"]
    assert tuple(out.shape) == (64, 257)  # ggml order: ne0 = n_embd, ne1 = n_vocab
    np.testing.assert_array_equal(
        quants.dequantize(out.data, out.tensor_type),
        np.asarray(jnp.asarray(flat_params(model)["lm_head.kernel"], jnp.bfloat16), np.float32).T,
    )


@pytest.mark.parametrize(
    "fmt, stored, ggml",
    [
        ("bf16", "bf16", "BF16"),
        ("q8_0", "q8_0", "Q8_0"),
        ("mxfp4", "mxfp4", "MXFP4"),
        ("fp8_e4m3", "q8_0", "Q8_0"),
    ],
)
@pytest.mark.parametrize("tied", [True, False])
def test_quantized_embedding_and_lm_head(tmp_path, fmt, stored, ggml, tied):
    """embed_format: token_embd (and an untied output.weight) stored in ggml's type, decoded
    by the gguf package to microscale's own quantization of the float weights (one block
    row per token), and a smaller file than the BF16 embedding gives."""
    params = flat_params(make_model(TINY.replace(tie_embeddings=tied)))
    cfg = TINY.replace(tie_embeddings=tied)
    path, base = tmp_path / "m.gguf", tmp_path / "base.gguf"
    res = write_gguf(
        params, path, config=cfg, layer_formats="q8_0", tokenizer=ByteTokenizer(), embed_format=fmt
    )
    assert res.embedding == stored and res.describe()["embedding"] == stored
    names = {t.name: t for t in GGUFReader(path).tensors}
    heads = {"token_embd.weight": params["embed.embedding"]}
    if not tied:
        heads["output.weight"] = jnp.asarray(params["lm_head.kernel"]).T
    for name, w in heads.items():
        t = names[name]
        assert t.tensor_type == gguf.GGMLQuantizationType[ggml], name
        want = (
            np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32)
            if stored == "bf16"
            else np.asarray(dequantize(quantize(jnp.asarray(w, jnp.float32), stored, axis=1)))
        )
        got = quants.dequantize(t.data, t.tensor_type).reshape(want.shape)
        np.testing.assert_array_equal(got, want)
        assert name.replace(".weight", ".scale") not in names
    if stored != "bf16":
        write_gguf(params, base, config=cfg, layer_formats="q8_0", tokenizer=ByteTokenizer())
        assert path.stat().st_size < base.stat().st_size


@pytest.mark.parametrize(
    "fmt, match", [("nvfp4", r"embed_format='nvfp4'.*tensor scale"), ("int3", "int3")]
)
def test_refuses_embedding_formats_llama_cpp_cannot_look_up(tmp_path, tiny_model, fmt, match):
    path = tmp_path / "m.gguf"
    with pytest.raises(ValueError, match=match):
        write_gguf(tiny_model, path, tokenizer=ByteTokenizer(), embed_format=fmt)
    assert not path.exists()


@pytest.mark.slow
@pytest.mark.parametrize("fmt, ok", [("nvfp4", False), ("mxfp4", True), ("q8_0", True)])
def test_refuses_rows_ggml_cannot_hold(tmp_path, fmt, ok):
    cfg = TINY.replace(d_model=96, n_heads=2, n_kv_heads=2)  # K = 96: 1.5 NVFP4 blocks
    path = tmp_path / "m.gguf"
    if ok:
        write_gguf(make_model(cfg), path, layer_formats=fmt, tokenizer=ByteTokenizer())
        return
    with pytest.raises(
        ValueError,
        match=r"blk\.0\.attn_q: input dimension 96 is not a "
        r"multiple of 64",
    ):
        write_gguf(make_model(cfg), path, layer_formats=fmt, tokenizer=ByteTokenizer())
    assert not path.exists()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "q8_0", "bf16"])
def test_refuses_non_finite_weights(tmp_path, fmt):
    params = flat_params(make_model())
    params["layers.1.mlp.up_proj.kernel"] = (
        params["layers.1.mlp.up_proj.kernel"].at[3, 5].set(jnp.nan)
    )
    path = tmp_path / "m.gguf"
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up.*non-finite"):
        write_gguf(params, path, config=TINY, layer_formats=fmt, tokenizer=ByteTokenizer())
    assert not path.exists()


def test_llama_quantize_refuses_an_unknown_preset(tmp_path):
    from microscale.export.gguf.llamacpp import llama_quantize

    with pytest.raises(ValueError, match=r"ftype='q4_k_x'.*q4_k_m"):
        llama_quantize(tmp_path / "a.gguf", tmp_path / "b.gguf", "q4_k_x")


def test_bad_arguments(tmp_path, tiny_model):
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        write_gguf(tiny_model, tmp_path / "a.gguf")
    with pytest.raises(IsADirectoryError, match="is a folder"):
        write_gguf(tiny_model, tmp_path, tokenizer=ByteTokenizer())
    (tmp_path / "b.gguf").write_bytes(b"old")
    with pytest.raises(FileExistsError, match="overwrite"):
        write_gguf(tiny_model, tmp_path / "b.gguf", tokenizer=ByteTokenizer())
    with pytest.raises(ValueError, match="dtype='int4'"):
        write_gguf(tiny_model, tmp_path / "c.gguf", tokenizer=ByteTokenizer(), dtype="int4")


@pytest.mark.slow
def test_killed_write_leaves_no_file(tmp_path, tiny_model, monkeypatch):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"previous")

    def boom(self, *a, **k):
        raise KeyboardInterrupt  # the process is interrupted mid-write

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)
    with pytest.raises(KeyboardInterrupt):
        write_gguf(tiny_model, path, tokenizer=ByteTokenizer(), overwrite=True)
    assert path.read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["m.gguf"]


def test_cli_packed_folder_keeps_its_allocation_and_bytes(tmp_path, tiny_model, mixed, capsys):
    from microscale.cli import main
    from microscale.export import export_checkpoint, read_checkpoint

    folder = tmp_path / "ct"
    export_checkpoint(tiny_model, folder, layer_formats=mixed, tokenizer=ByteTokenizer())
    out = tmp_path / "m.gguf"
    assert main(["export", "--model", str(folder), "layout=gguf", "--out", str(out)]) == 0, (
        capsys.readouterr().err
    )
    assert "q8_0" in capsys.readouterr().out
    ck = read_checkpoint(folder)
    tensors = {t.name: t for t in GGUFReader(out).tensors}
    for p, f in mixed.items():
        t = tensors[f"{gname(p)}.weight"]
        assert t.tensor_type.name == {"nvfp4": "NVFP4", "fp8_e4m3": "Q8_0", "bf16": "BF16"}[f]
        if f == "nvfp4" and p.endswith("v_proj"):  # not RoPE-permuted: same bytes as the folder
            blocks, _ = gguf_tensor(ck.params[f"{p}.kernel"], p)
            np.testing.assert_array_equal(np.asarray(t.data).reshape(blocks.shape), blocks)
    assert (
        main(
            [
                "export",
                "--model",
                str(folder),
                "layout=gguf",
                "--out",
                str(tmp_path / "m2.gguf"),
                "activations=true",
            ]
        )
        == 2
    )
    assert "weights only" in capsys.readouterr().err
    # --embed-format: the same layers, token_embd in Q8_0; refused for other layouts
    assert (
        main(
            [
                "export",
                "--model",
                str(folder),
                "layout=gguf",
                "--out",
                str(tmp_path / "m3.gguf"),
                "embed_format=q8_0",
            ]
        )
        == 0
    )
    t3 = {t.name: t for t in GGUFReader(tmp_path / "m3.gguf").tensors}
    assert t3["token_embd.weight"].tensor_type.name == "Q8_0"
    assert t3["blk.0.attn_v.weight"].tensor_type.name == "NVFP4"
    capsys.readouterr()
    assert (
        main(
            [
                "export",
                "--model",
                str(folder),
                "--out",
                str(tmp_path / "ct2"),
                "embed_format=q8_0",
            ]
        )
        == 2
    )
    assert (
        "embed_format='q8_0' has no effect with layout='compressed-tensors'"
        in capsys.readouterr().err
    )


def _gguf_llama_logits(path, tokens: np.ndarray, pairs: str = "adjacent") -> np.ndarray:
    """Logits of a GGUF Llama computed the way llama.cpp's graph reads the file
    (src/models/llama.cpp, ggml_rope mode NORM: RoPE on adjacent pairs (2i, 2i+1)),
    written from those conventions with weights decoded by gguf.quants only."""
    r = GGUFReader(path)

    def f(key):
        fl = r.fields[key]
        return fl.contents() if hasattr(fl, "contents") else fl.parts[fl.data[0]][0]

    def w(name):
        t = ts[name]
        x = quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        s = ts.get(name.replace(".weight", ".scale"))
        return x * float(s.data[0]) if s is not None else x

    ts = {t.name: t for t in r.tensors}
    n_layer, n_head = int(f("llama.block_count")), int(f("llama.attention.head_count"))
    n_kv, eps = (
        int(f("llama.attention.head_count_kv")),
        float(f("llama.attention.layer_norm_rms_epsilon")),
    )
    base = float(f("llama.rope.freq_base"))
    T = len(tokens)
    x = w("token_embd.weight")[tokens]
    hd = x.shape[1] // n_head
    pos = np.arange(T)[:, None] * base ** (-np.arange(0, hd, 2) / hd)[None]  # [T, hd/2]
    cos, sin = np.cos(pos)[:, None], np.sin(pos)[:, None]

    def rms(v, g):
        return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + eps) * g

    def rope(v):  # [T, heads, hd]; llama.cpp's LLAMA graph: adjacent pairs (NORM mode)
        ia, ib = (
            (np.arange(0, hd, 2), np.arange(1, hd, 2))
            if pairs == "adjacent"
            else (np.arange(hd // 2), np.arange(hd // 2, hd))
        )  # "halves": NEOX mode, for a control
        a, b = v[..., ia], v[..., ib]
        out = np.empty_like(v)
        out[..., ia], out[..., ib] = a * cos - b * sin, a * sin + b * cos
        return out

    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(n_layer):
        h = rms(x, w(f"blk.{i}.attn_norm.weight"))
        q = rope((h @ w(f"blk.{i}.attn_q.weight").T).reshape(T, n_head, hd))
        k = rope((h @ w(f"blk.{i}.attn_k.weight").T).reshape(T, n_kv, hd))
        v = (h @ w(f"blk.{i}.attn_v.weight").T).reshape(T, n_kv, hd)
        k, v = np.repeat(k, n_head // n_kv, 1), np.repeat(v, n_head // n_kv, 1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", p, v).reshape(T, -1)
        x = x + o @ w(f"blk.{i}.attn_output.weight").T
        h = rms(x, w(f"blk.{i}.ffn_norm.weight"))
        g = h @ w(f"blk.{i}.ffn_gate.weight").T
        x = (
            x
            + (g / (1 + np.exp(-g)) * (h @ w(f"blk.{i}.ffn_up.weight").T))
            @ w(f"blk.{i}.ffn_down.weight").T
        )
    x = rms(x, w("output_norm.weight"))
    out = w("output.weight") if "output.weight" in ts else w("token_embd.weight")
    return x @ out.T


def test_gguf_read_as_llama_cpp_does_reproduces_microscale_logits(tmp_path, tiny_model):
    """Names, orientation, the q/k RoPE permutation, .scale tensors and metadata together:
    the file read with llama.cpp's conventions gives microscale's own logits."""
    from microscale.inference import InferenceModel

    path = tmp_path / "m.gguf"
    params = flat_params(tiny_model)
    write_gguf(
        params, path, config=TINY, layer_formats=ALLOC, tokenizer=ByteTokenizer(), dtype="float32"
    )
    tokens = np.array(ByteTokenizer().encode("def fib(n):\n    return n"), np.int64)
    got = _gguf_llama_logits(path, tokens)
    stored = {p: gguf_format(f) for p, f in ALLOC.items()}
    ref = InferenceModel.from_params(params, TINY, formats=stored, compute_dtype=jnp.float32)
    want = np.asarray(ref.logits(tokens[None].astype(np.int32)))[0]
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-5, rel
    # control: the same file read with the other RoPE pairing gives other logits, so the
    # agreement above depends on the q/k row permutation
    other = _gguf_llama_logits(path, tokens, pairs="halves")
    assert np.linalg.norm(other - want) / np.linalg.norm(want) > 1e-3
