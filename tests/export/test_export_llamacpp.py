"""End to end with llama.cpp itself: a trained tiny model and a searched mixed allocation,
exported to GGUF, loaded and run by llama.cpp, against microscale's engine on the same
tokens. Skipped without llama.cpp (``pip install '.[llama]'``, or ``MICROSCALE_LIBLLAMA``; the
build flags are in docs/llamacpp.md).

llama.cpp quantizes a quantized matmul's activations to 8 bits on CPU, so the bar is
agreement, not bit-exactness: relative L2 of the logits <= 5e-2 and top-1 agreement >= 95%
for the quantized files, about 5e-4 for the unquantized float32 file (the floor: both
engines compute in float32 with different summation orders), and the same first greedy
tokens. The measured numbers are printed (pytest -s).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from microscale.data import ByteTokenizer, DataConfig
from microscale.export import flat_params, linear_paths
from microscale.export.gguf.llamacpp import (
    LlamaCpp,
    llama_cpp_available,
    llama_quantize,
    logits_agreement,
)
from microscale.export.gguf.tensors import gguf_format
from microscale.export.gguf.writer import write_gguf
from microscale.formats import dequantize, quantize
from microscale.inference import InferenceModel
from microscale.model import ModelConfig

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        llama_cpp_available() is None,
        reason="no llama.cpp (pip install '.[llama]' or set MICROSCALE_LIBLLAMA)",
    ),
]

CFG = ModelConfig(
    vocab_size=257, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256, max_seq_len=128
)
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import os\nimport sys\n\n\nclass Path:\n    def __init__(self, ",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_dir):
    from microscale.train import OptimConfig, TrainConfig, load_checkpoint, train

    out = tmp_path_factory.mktemp("llama-run") / "run"
    train(
        TrainConfig(
            model=CFG,
            data=DataConfig(
                corpus=corpus_dir,
                heldout="none",
                seq_len=64,
                batch_size=8,
                eval_batches=2,
                val_fraction=0.2,
                prefetch=1,
                cache_dir=str(tmp_path_factory.mktemp("c")),
            ),
            optim=OptimConfig(lr=3e-3, warmup_steps=10),
            steps=120,
            eval_every=120,
            log_every=40,
            tensorboard=False,
            out=str(out),
        ),
        progress=False,
    )
    model, _, _ = load_checkpoint(out)
    return flat_params(model)


def _compare(params, formats, path, dtype="bfloat16", embed_format="bf16"):
    tok = ByteTokenizer()
    write_gguf(
        params,
        path,
        config=CFG,
        layer_formats=formats,
        tokenizer=tok,
        dtype=dtype,
        embed_format=embed_format,
    )
    stored = (
        None
        if formats == "bf16"
        else (
            {p: gguf_format(f) for p, f in formats.items()}
            if isinstance(formats, dict)
            else gguf_format(formats)
        )
    )
    ref_params = dict(params)
    if dtype == "bfloat16":  # the file's embedding and bf16 layers are stored in bf16
        layers = (
            stored
            if isinstance(stored, dict)
            else dict.fromkeys(linear_paths(CFG), stored or "bf16")
        )
        for k in ["embed.embedding"] + [f"{p}.kernel" for p, f in layers.items() if f == "bf16"]:
            ref_params[k] = jnp.asarray(params[k], jnp.bfloat16).astype(jnp.float32)
    if embed_format != "bf16":  # the file's embedding / tied LM head, as stored
        ref_params["embed.embedding"] = dequantize(
            quantize(
                jnp.asarray(params["embed.embedding"], jnp.float32),
                gguf_format(embed_format),
                axis=1,
            )
        )
    ref = InferenceModel.from_params(ref_params, CFG, formats=stored, compute_dtype=jnp.float32)
    llm = LlamaCpp(path, n_ctx=CFG.max_seq_len)
    rels, agree, n = [], 0, 0
    for text in PROMPTS:
        ids = tok.encode(text)
        assert llm.tokenize(text) == ids  # llama.cpp's tokenizer = microscale's
        rel, top1 = logits_agreement(
            llm.logits(ids), np.asarray(ref.logits(np.asarray([ids], np.int32)))[0]
        )
        rels.append(rel)
        agree += top1
        n += len(ids)
        got, _ = llm.greedy(ids, 8)
        want = ref.generate([ids], _gen(8)).rows()[0]
        assert got[:4] == want[:4], (got, want)  # the same first greedy tokens
    llm.close()
    return max(rels), agree / n


def _gen(n):
    from microscale.inference import GenerationConfig

    return GenerationConfig(max_new_tokens=n, stop_tokens=())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "q8_0"])
def test_uniform_formats_agree_with_microscale(trained, tmp_path, fmt):
    rel, top1 = _compare(trained, fmt, tmp_path / f"{fmt}.gguf")
    print(f"\nllama.cpp vs microscale, uniform {fmt}: rel L2 {rel:.2e}, top-1 {top1:.3f}")
    assert rel <= 5e-2 and top1 >= 0.95


@pytest.mark.parametrize("embed", ["q8_0", "mxfp4"])
def test_quantized_embedding_and_tied_head_agree(trained, tmp_path, embed):
    """A quantized token_embd serves llama.cpp's embedding lookup (get_rows) and its tied LM
    head: the logits agree with microscale's on the same quantized embedding."""
    rel, top1 = _compare(trained, "nvfp4", tmp_path / f"e-{embed}.gguf", embed_format=embed)
    print(
        f"\nllama.cpp vs microscale, nvfp4 + {embed} embedding: rel L2 {rel:.2e}, top-1 {top1:.3f}"
    )
    assert rel <= 5e-2 and top1 >= 0.95


@pytest.mark.parametrize("ftype, ggml, bar", [("q8_0", "Q8_0", 1e-2), ("q4_0", "Q4_0", 5e-2)])
def test_llama_cpp_own_quantizer_on_a_microscale_file(trained, tmp_path, ftype, ggml, bar):
    """llama_quantize (llama.cpp's llama_model_quantize) turns a microscale BF16 GGUF into
    its own preset: the linear layers get the preset's type, and the file runs close to the
    BF16 file's logits (measured 1.8e-3 for Q8_0 and 8.1e-3 for Q4_0: the bars leave ~5x)."""
    from gguf import GGUFReader

    src, dst = tmp_path / "bf16.gguf", tmp_path / f"{ftype}.gguf"
    write_gguf(trained, src, config=CFG, layer_formats="bf16", tokenizer=ByteTokenizer())
    llama_quantize(src, dst, ftype, n_threads=1)
    types = {t.name: t.tensor_type.name for t in GGUFReader(dst).tensors}
    assert types["blk.0.attn_q.weight"] == ggml, types
    ids = ByteTokenizer().encode(PROMPTS[0])
    a, b = LlamaCpp(dst, n_ctx=CFG.max_seq_len, verify=False), LlamaCpp(src, n_ctx=CFG.max_seq_len)
    rel, top1 = logits_agreement(a.logits(ids), b.logits(ids))
    a.close(), b.close()
    print(f"\nllama.cpp {ftype} vs its BF16 input: rel L2 {rel:.2e}, top-1 {top1}/{len(ids)}")
    assert 0 < rel <= bar


def test_unquantized_float32_floor(trained, tmp_path):
    rel, top1 = _compare(trained, "bf16", tmp_path / "f32.gguf", dtype="float32")
    print(f"\nllama.cpp vs microscale, float32 file: rel L2 {rel:.2e}, top-1 {top1:.3f}")
    assert rel <= 2e-3 and top1 >= 0.99


def test_searched_mixed_allocation_agrees(trained, tmp_path):
    from microscale.export import build_model
    from microscale.ptq import QuantizeConfig, quantize_model

    rng = np.random.default_rng(0)
    toks = np.asarray(ByteTokenizer().encode(" ".join(PROMPTS) * 20), np.int32)
    starts = rng.integers(0, len(toks) - 65, 16)
    batches = np.stack([toks[s : s + 65] for s in starts]).reshape(4, 4, 65)
    res = quantize_model(
        build_model(CFG, trained),
        batches[:2],
        batches[2:],
        QuantizeConfig.for_gguf(
            fp4=True, budget=5.0, calib_tokens=512, ptq_effects=False, pareto_budgets=()
        ),
    )
    formats = dict(res.allocation.formats)
    assert len(set(formats.values())) >= 2, formats  # a mixed allocation
    params = dict(trained)
    for p, w in res.weights.items():
        if w.format != "bf16":
            params[f"{p}.kernel"] = w.qarray
    rel, top1 = _compare(params, formats, tmp_path / "mixed.gguf")
    print(
        f"\nllama.cpp vs microscale, searched {res.allocation.counts()} at "
        f"{res.allocation.effective_bits:.2f} bits: rel L2 {rel:.2e}, top-1 {top1:.3f}"
    )
    assert rel <= 5e-2 and top1 >= 0.95
