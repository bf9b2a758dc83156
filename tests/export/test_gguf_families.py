"""GGUF export and GGUF -> HF import for every model family, against what llama.cpp reads.

The expectations are written here from llama.cpp's own sources, not from the writer's
tables: ``convert_hf_to_gguf.py`` (``LlamaModel`` takes ``LlamaForCausalLM`` and
``MistralForCausalLM`` to ``general.architecture`` ``llama`` and permutes q/k rows and biases
with ``LlamaModel.permute``; ``Qwen2Model`` / ``Qwen3Model`` write ``qwen2`` / ``qwen3`` and
permute nothing; ``TextModel.set_gguf_parameters`` writes ``{arch}.attention.key_length`` and
``value_length`` for an explicit ``head_dim``), gguf-py's ``constants.py`` (``blk.N.attn_q.bias``,
``blk.N.attn_q_norm.weight``, ...) and ``src/models/{llama,qwen2,qwen3}.cpp`` (no sliding
window; qwen2's ``build_ffn`` gets no ``.scale`` tensors). Gemma 3: ``Gemma3Model`` adds 1 to
every ``*norm.weight``, writes ``key_length`` always and ``sliding_window``, neither a layer
pattern nor a local RoPE base; llama.cpp's ``LLM_ARCH_GEMMA3`` makes layer ``i`` local iff
``i % 6 < 5`` (base 10000, unscaled), scales q by ``head_dim ** -0.5`` (62 layers: ``(d_model
// n_heads) ** -0.5``), the embedding by ``sqrt(n_embd)``; its ``build_ffn`` gets no scales.

Each family's tiny random model (vocab 257, d_model 64, 2 layers, 4 heads, 2 kv heads,
d_ff 128; norms and qwen2's biases off 0/1) round-trips through ``write_gguf`` and
``gguf_to_hf`` / ``read_gguf_params`` bit for bit (float32 and bf16 files; NVFP4 to its
decoded values). With llama.cpp present (``MICROSCALE_LIBLLAMA`` or ``llama_cpp``), its
logits and greedy tokens on each family's file are compared with microscale's engine.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from microscale.data import ByteTokenizer
from microscale.export import flat_params
from microscale.export import layouts as L
from microscale.export.gguf.llamacpp import llama_cpp_available
from microscale.export.gguf.writer import write_gguf
from microscale.export.hf import hf_param_name, model_config_from_hf
from microscale.formats import dequantize
from microscale.model import ModelConfig, RopeScaling, linear_paths

from .conftest import make_model

gguf = pytest.importorskip("gguf")
from gguf import GGUFReader  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from microscale.export.gguf.to_hf import gguf_model_config, gguf_to_hf, read_gguf_params  # noqa: E402
from microscale.export.gguffile import GGUFContents, open_gguf  # noqa: E402

BASE = dict(vocab_size=257, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
CONFIGS = {
    "llama": ModelConfig(**BASE, max_seq_len=64),
    "mistral": ModelConfig(**BASE, family="mistral", attn_head_dim=32, max_seq_len=64),
    "qwen2": ModelConfig(**BASE, family="qwen2", tie_embeddings=False, max_seq_len=64),
    "qwen3": ModelConfig(**BASE, family="qwen3", attn_head_dim=32, max_seq_len=64),
    # six layers: five local (window 16 < the prompt, RoPE base 10000), one global (1e6)
    "gemma3": ModelConfig(
        **BASE | {"n_layers": 6},
        family="gemma3",
        attn_head_dim=32,
        max_seq_len=64,
        sliding_window=16,
        sliding_window_pattern=6,
        rope_local_theta=10000.0,
        rope_theta=1e6,
    ),
}
# What llama.cpp expects of each family's file: general.architecture, whether q/k rows
# (and biases) are permuted for its adjacent-pair RoPE, the extra tensors of a block,
# config.json's architectures[0].
GOLDEN = {
    "llama": ("llama", True, (), "LlamaForCausalLM"),
    "mistral": ("llama", True, (), "MistralForCausalLM"),
    "qwen2": ("qwen2", False, ("attn_q.bias", "attn_k.bias", "attn_v.bias"), "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", False, ("attn_q_norm.weight", "attn_k_norm.weight"), "Qwen3ForCausalLM"),
    "gemma3": (
        "gemma3",
        False,
        (
            "attn_q_norm.weight",
            "attn_k_norm.weight",
            "post_attention_norm.weight",
            "post_ffw_norm.weight",
        ),
        "Gemma3ForCausalLM",
    ),
}
BLOCK = (
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)
# llama.cpp's qwen2 and gemma3 graphs drop NVFP4's tensor scale on the MLP: MXFP4 there.
QUANT = {
    fam: {
        p: "mxfp4" if fam in ("qwen2", "gemma3") and ".mlp." in p else "nvfp4"
        for p in linear_paths(cfg)
    }
    for fam, cfg in CONFIGS.items()
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (q: n_head, k: n_head_kv), verbatim."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.fixture(scope="module")
def models():
    """Each family's random model; Gemma 3's norm weights w = 0.1 N, so that its norms'
    factors 1 + w are the other families' (make_model draws 1 + 0.1 N)."""
    out = {fam: flat_params(make_model(cfg)) for fam, cfg in CONFIGS.items()}
    out["gemma3"] = {
        k: v - 1.0 if k.endswith("norm.scale") else v for k, v in out["gemma3"].items()
    }
    return out


def _write(params, cfg, path, **kw):
    kw.setdefault("layer_formats", "bf16")
    return write_gguf(params, path, config=cfg, tokenizer=ByteTokenizer(), **kw)


def _shape(cfg: ModelConfig) -> dict:
    """The fields a GGUF holds (norm_eps as float32)."""
    return {
        "family": cfg.family,
        "dims": (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads),
        "d_ff": cfg.d_ff,
        "head_dim": (cfg.attn_head_dim, cfg.head_dim),
        "context": cfg.max_seq_len,
        "tied": cfg.tie_embeddings,
        "rope": (cfg.rope_theta, cfg.rope_scaling),
        "eps": float(np.float32(cfg.norm_eps)),
        "layers": (cfg.sliding_window, cfg.sliding_window_pattern, cfg.rope_local_theta),
        "scalar": cfg.query_pre_attn_scalar,
    }


def _norm_back(cfg: ModelConfig, key: str, v) -> np.ndarray:
    """What a float32 parameter reads back as: Gemma's norms are stored as 1 + w (the
    converter's + 1) and read as (1 + w) - 1, float32 (so 1 + w comes back exactly)."""
    v = np.asarray(v, np.float32)
    if not (key.endswith("norm.scale") and cfg.arch.norm_offset):
        return v
    return (np.float32(1.0) + v).astype(np.float32) - np.float32(1.0)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_float32_file_round_trips_bit_exact(models, tmp_path, family):
    cfg, params = CONFIGS[family], models[family]
    path = tmp_path / f"{family}.gguf"
    _write(params, cfg, path, dtype="float32")
    back, got_cfg = read_gguf_params(path)
    assert _shape(got_cfg) == _shape(cfg)
    assert set(back) == set(params)
    for k, v in params.items():
        np.testing.assert_array_equal(back[k], _norm_back(cfg, k, v), err_msg=k)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_bf16_file_to_hf_folder(models, tmp_path, family):
    """bf16 weights come back as their bf16 values, norms / biases / q/k norms exactly
    (F32 in the file); config.json is the family's and reads back as the same model."""
    cfg, params = CONFIGS[family], models[family]
    path = tmp_path / f"{family}.gguf"
    _write(params, cfg, path)
    out = gguf_to_hf(path, tmp_path / "hf")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == [GOLDEN[family][3]]
    assert conf["head_dim"] == cfg.head_dim
    assert _shape(model_config_from_hf(conf)) == _shape(cfg)
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == {hf_param_name(k, family) for k in params}
    for k, v in params.items():
        want = _norm_back(cfg, k, v)
        if k.endswith(".kernel") or k == "embed.embedding":
            want = np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32)
        if k.endswith(".kernel"):
            want = want.T
        np.testing.assert_array_equal(tensors[hf_param_name(k, family)], want, err_msg=k)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_arch_keys_and_tensor_names_are_llama_cpps(models, tmp_path, family):
    cfg, params = CONFIGS[family], models[family]
    arch, permuted, extra, _ = GOLDEN[family]
    path = tmp_path / f"{family}.gguf"
    _write(params, cfg, path, dtype="float32")
    r = GGUFReader(path)
    field = {k: f.contents() for k, f in r.fields.items()}
    assert field["general.architecture"] == arch
    assert field["microscale.family"] == family
    want = {
        "block_count": cfg.n_layers,
        "context_length": 64,
        "embedding_length": 64,
        "feed_forward_length": 128,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "rope.dimension_count": cfg.head_dim,
    }
    # an explicit head_dim (and every Gemma 3): as the converter writes it
    key_length = cfg.attn_head_dim is not None or family == "gemma3"
    if key_length:
        want |= {"attention.key_length": 32, "attention.value_length": 32}
    for key, v in want.items():
        assert field[f"{arch}.{key}"] == v, key
    assert np.isclose(field[f"{arch}.attention.layer_norm_rms_epsilon"], cfg.norm_eps)
    assert (f"{arch}.attention.key_length" in field) == key_length
    others = {k.split(".")[0] for k in field} - {arch, "general", "tokenizer", "microscale", "GGUF"}
    assert not others, others  # every model key under the file's architecture
    tensors = {t.name: t for t in r.tensors}
    names = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}" for i in range(cfg.n_layers) for n in BLOCK + extra
    }
    if not cfg.tie_embeddings:
        names.add("output.weight")
    assert set(tensors) == names
    hd, q_rows = cfg.head_dim, cfg.n_heads * cfg.head_dim
    assert list(tensors["blk.0.attn_q.weight"].shape) == [64, q_rows]  # ne: [in, out]
    assert list(tensors["blk.1.attn_output.weight"].shape) == [q_rows, 64]
    for n in extra:
        t = tensors[f"blk.1.{n}"]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        n_rows = (
            (hd if n.startswith("attn_") else 64)
            if "norm" in n
            else (q_rows if "attn_q" in n else cfg.n_kv_heads * hd)
        )
        assert list(t.shape) == [n_rows], n
    for proj, heads in (("q", cfg.n_heads), ("k", cfg.n_kv_heads)):
        hf = np.asarray(params[f"layers.1.attn.{proj}_proj.kernel"], np.float32).T
        stored = np.asarray(tensors[f"blk.1.attn_{proj}.weight"].data).reshape(hf.shape)
        np.testing.assert_array_equal(stored, llama_cpp_permute(hf, heads) if permuted else hf)
        if f"attn_{proj}.bias" in extra:  # qwen2: as HF (a llama-arch bias would be permuted)
            bias = np.asarray(tensors[f"blk.1.attn_{proj}.bias"].data)
            np.testing.assert_array_equal(bias, params[f"layers.1.attn.{proj}_proj.bias"])
    if "attn_q_norm.weight" in extra:
        # Gemma 3: every norm weight stored with the + 1 of Gemma3Model.modify_tensors baked in
        shift = np.float32(1.0 if family == "gemma3" else 0.0)
        for name, key in (
            ("blk.0.attn_k_norm.weight", "layers.0.attn.k_norm.scale"),
            ("blk.0.attn_norm.weight", "layers.0.attn_norm.scale"),
            ("output_norm.weight", "final_norm.scale"),
        ) + ((("blk.5.post_ffw_norm.weight", "layers.5.mlp_post_norm.scale"),) if shift else ()):
            np.testing.assert_array_equal(tensors[name].data, shift + params[key], err_msg=name)
    if family == "gemma3":  # the keys llama.cpp's gemma3 reads, none it would not
        assert field["gemma3.attention.sliding_window"] == 16
        assert field["gemma3.rope.freq_base"] == 1e6
        for absent in ("attention.sliding_window_pattern", "rope.freq_base_swa"):
            assert f"gemma3.{absent}" not in field


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_quantized_file_reads_back_the_decoded_weights(models, tmp_path, family):
    """NVFP4 (MXFP4 on qwen2's MLP): the weights read back are microscale's dequantized
    ones, the ``.scale`` tensor multiplied in, bit for bit."""
    cfg, params = CONFIGS[family], models[family]
    path = tmp_path / f"{family}.gguf"
    _write(params, cfg, path, layer_formats=QUANT[family])
    back, _ = read_gguf_params(path)
    layers = {p: L.LayerQuant(weights=f) for p, f in QUANT[family].items()}
    qs = L.quantize_linear_weights(params, cfg, layers)
    for p in linear_paths(cfg):
        np.testing.assert_array_equal(back[f"{p}.kernel"], np.asarray(dequantize(qs[p])), p)


def test_mistral_window_shorter_than_the_context_is_refused(models, tmp_path):
    params = models["llama"]
    cfg = ModelConfig(**BASE, family="mistral", sliding_window=32, max_seq_len=64)
    with pytest.raises(ValueError, match=r"sliding_window=32 < max_seq_len=64"):
        _write(params, cfg, tmp_path / "w.gguf")
    assert not (tmp_path / "w.gguf").exists()
    # a window as long as the context changes nothing: written as llama, read as Mistral
    _write(params, cfg.replace(sliding_window=64), tmp_path / "ok.gguf")
    got = gguf_model_config(open_gguf(tmp_path / "ok.gguf"))
    assert (got.family, got.sliding_window) == ("mistral", None)


def test_refusals_name_the_key(models, tmp_path):
    qwen2 = CONFIGS["qwen2"]
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.gate_proj in nvfp4: .*qwen2 graph"):
        _write(models["qwen2"], qwen2, tmp_path / "a.gguf", layer_formats="nvfp4")
    wide = ModelConfig(**BASE, family="qwen2", attn_head_dim=32, max_seq_len=64)
    with pytest.raises(ValueError, match=r"qwen2 graph needs n_heads \* head_dim == d_model"):
        _write(flat_params(make_model(wide)), wide, tmp_path / "b.gguf")
    llama3 = CONFIGS["qwen3"].replace(
        rope_scaling=RopeScaling(kind="llama3", factor=8.0, original_max_position_embeddings=16)
    )
    with pytest.raises(ValueError, match=r"qwen3 graph does not read rope_freqs\.weight"):
        _write(models["qwen3"], llama3, tmp_path / "c.gguf")
    assert not any(tmp_path.iterdir())  # refused before any file was written


def test_gemma3_refusals_name_the_key(models, tmp_path):
    """What llama.cpp's gemma3 graph would run otherwise: a layer pattern other than 6, a
    local RoPE base other than 10000, a query_pre_attn_scalar other than head_dim, yarn."""
    cfg, params = CONFIGS["gemma3"], models["gemma3"]
    cases = [
        (cfg.replace(sliding_window_pattern=3), r"layer 2 as local .*sliding_window_pattern=3"),
        (cfg.replace(rope_local_theta=20000.0), r"layer 0 as local .*rope_local_theta=20000"),
        (cfg.replace(sliding_window_pattern=0), r"layer 5 as global .*sliding_window_pattern=0"),
        (cfg.replace(query_pre_attn_scalar=64), r"query_pre_attn_scalar=64"),
        (cfg, r"layers\.0\.mlp\.gate_proj in nvfp4: .*gemma3 graph does not apply"),
        (
            cfg.replace(
                rope_scaling=RopeScaling(
                    kind="yarn", factor=4.0, original_max_position_embeddings=16
                )
            ),
            r"rope_scaling.kind='yarn' cannot be stored for family 'gemma3'",
        ),
    ]
    for bad, msg in cases:
        with pytest.raises(ValueError, match=msg):
            _write(params, bad, tmp_path / "g.gguf", layer_formats="nvfp4")
    assert not any(tmp_path.iterdir())
    # no window is one as long as the context; linear scaling reaches the global layer only
    ok = cfg.replace(sliding_window=None, rope_scaling=RopeScaling(kind="linear", factor=8.0))
    _write(params, ok, tmp_path / "ok.gguf")
    got = gguf_model_config(open_gguf(tmp_path / "ok.gguf"))
    assert _shape(got) == _shape(ok)


class _Mistral(GGUFContents):
    """A file whose ``microscale.family`` reads as mistral."""

    def value(self, key, default=...):
        return "mistral" if key == "microscale.family" else super().value(key, default)


def test_reader_refuses_a_foreign_family_record_and_unread_tensors(models, tmp_path):
    from microscale.export.gguf.to_hf import _hf_tensors

    path = tmp_path / "qwen2.gguf"
    _write(models["qwen2"], CONFIGS["qwen2"], path, dtype="float32")
    f = open_gguf(path)
    with pytest.raises(ValueError, match=r"microscale.family='mistral': not a family of .*qwen2"):
        gguf_model_config(_Mistral(header=f.header, buf=f.buf))
    norm = next(t for t in f.tensors if t.name == "blk.0.attn_q.bias")
    extra = dataclasses.replace(norm, name="blk.0.attn_q_norm.weight")
    r = GGUFContents(header=dataclasses.replace(f.header, tensors=[*f.tensors, extra]), buf=f.buf)
    with pytest.raises(ValueError, match=r"'blk.0.attn_q_norm.weight': .* qwen2 model has no"):
        _hf_tensors(r, gguf_model_config(r))


# ---------------------------------------------------------------------- llama.cpp itself

needs_llama_cpp = pytest.mark.skipif(
    llama_cpp_available() is None,
    reason="no llama.cpp (pip install '.[llama]' or set MICROSCALE_LIBLLAMA)",
)
PROMPT = "def f(x):\n    return x + 1\n"


def _agreement(params, cfg, path, formats):
    """(rel L2 of the logits, top-1 agreement, llama.cpp's and microscale's greedy tokens)."""
    from microscale.export.gguf.llamacpp import LlamaCpp, logits_agreement
    from microscale.inference import GenerationConfig, InferenceModel

    ids = ByteTokenizer().encode(PROMPT)
    stored = None if formats == "bf16" else formats
    ref = InferenceModel.from_params(params, cfg, formats=stored, compute_dtype=jnp.float32)
    llm = LlamaCpp(path, n_ctx=cfg.max_seq_len)
    try:
        assert llm.tokenize(PROMPT) == ids
        rel, top1 = logits_agreement(
            llm.logits(ids), np.asarray(ref.logits(np.asarray([ids], np.int32)))[0]
        )
        got, _ = llm.greedy(ids, 8)
    finally:
        llm.close()
    want = ref.generate([ids], GenerationConfig(max_new_tokens=8, stop_tokens=())).rows()[0]
    return rel, top1 / len(ids), got, want


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("kind", ["float32", "quantized"])
@pytest.mark.slow
@needs_llama_cpp
def test_llama_cpp_runs_each_family_as_microscale(models, tmp_path, family, kind):
    """Measured (npm @node-llama-cpp/linux-x64 libllama, CPU): float32 rel L2 2.0e-4 (llama)
    to 4.9e-4 (qwen2); NVFP4 (MXFP4 MLP on qwen2) 2.7e-3 to 5.6e-3 (qwen3); top-1 27/27
    and the same 8 greedy tokens in every case. gemma3 (five local layers, window 16 <
    the 27-token prompt, one global; NVFP4 attention, MXFP4 MLP): float32 rel L2 6.2e-4, top-1
    27/27; quantized 1.3e-2, top-1 26/27; the same 8 greedy tokens in both."""
    cfg, params = CONFIGS[family], models[family]
    formats = "bf16" if kind == "float32" else QUANT[family]
    path = tmp_path / f"{family}.gguf"
    _write(params, cfg, path, layer_formats=formats, dtype="float32")
    rel, top1, got, want = _agreement(params, cfg, path, formats)
    print(f"\nllama.cpp vs microscale, {family} {kind}: rel L2 {rel:.2e}, top-1 {top1:.3f}")
    assert rel <= (2e-3 if kind == "float32" else 2e-2) and top1 >= 0.95
    assert got[:4] == want[:4], (got, want)


@pytest.mark.slow
@needs_llama_cpp
@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_llama_cpp_drops_the_mlp_tensor_scale(models, tmp_path, monkeypatch, family):
    """Why NVFP4 is refused on qwen2's and gemma3's MLP: forced past the refusal, llama.cpp's
    logits leave microscale's (their graphs load ``ffn_*.scale`` but never apply it; the
    MLP's weights are then ``1 / s_dec`` times too large: measured, NaN logits on both)."""
    from microscale.export.gguf import writer

    monkeypatch.setattr(writer, "check_scales", lambda arch, formats: None)
    cfg, params = CONFIGS[family], models[family]
    formats = dict.fromkeys(linear_paths(cfg), "nvfp4")
    _write(params, cfg, tmp_path / "forced.gguf", layer_formats=formats, dtype="float32")
    rel, *_ = _agreement(params, cfg, tmp_path / "forced.gguf", formats)
    print(f"\nllama.cpp vs microscale, {family} NVFP4 MLP forced: rel L2 {rel:.2e}")
    assert not rel <= 0.1  # NaN included
