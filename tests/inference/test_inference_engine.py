"""The inference engine: logits equal microscale's Transformer, KV-cache decode equals the
full forward pass, batching with left padding, sampling, stop tokens, packed memory."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from microscale.export import flat_params, linear_paths
from microscale.formats import QArray, dequantize
from microscale.inference import (
    GenerationConfig,
    InferenceModel,
    evaluate_ppl,
    forward,
    init_cache,
    sample_logits,
)
from microscale.model import ModelConfig, Transformer
from microscale.ptq.run import input_amax

CFG = ModelConfig(
    vocab_size=257, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64
)
CFG32 = CFG.replace(compute_dtype="float32")


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def packed32(model):
    return InferenceModel.from_params(model, CFG32, formats="nvfp4")


def _tokens(b=2, t=20, seed=1):
    return np.asarray(jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size))


def test_dense_engine_equals_the_transformer(model):
    tokens = _tokens()
    ref = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))
    got = np.asarray(InferenceModel.from_params(model, CFG).logits(tokens))
    np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)


def test_packed_engine_equals_dequantized_weights(model, packed32):
    """W4A16 on packed weights = a dense model holding the dequantized weights."""
    params = flat_params(model)
    deq = {**params}
    for p in linear_paths(CFG):
        q = packed32.weights["layers"][int(p.split(".")[1])][p.split(".", 2)[2]].weight
        assert isinstance(q, QArray)
        deq[f"{p}.kernel"] = np.asarray(dequantize(q)).T
    dense = InferenceModel.from_params(deq, CFG32)
    tokens = _tokens()
    np.testing.assert_allclose(
        np.asarray(packed32.logits(tokens)), np.asarray(dense.logits(tokens)), atol=2e-5, rtol=0
    )


@pytest.mark.slow
def test_kv_cache_decode_equals_full_forward(model, cdt="float32", atol=2e-5):
    """Prefill 6 tokens, decode 10 one at a time: the same logits as one full pass (float32
    compute; in bfloat16 the two differ by bf16 rounding of differently-shaped GEMMs)."""
    im = InferenceModel.from_params(model, CFG.replace(compute_dtype=cdt), formats="nvfp4")
    tokens = jnp.asarray(_tokens(t=16))
    full = im.logits(tokens)  # jitted forward(), no cache
    cache = init_cache(im.config, 2, 16, jnp.dtype(cdt))
    step = jax.jit(lambda w, t, c, i: forward(w, t, cfg=im.config, cdt=cdt, cache=c, index=i))
    logits, cache = step(im.weights, tokens[:, :6], cache, 0)  # prefill 6
    outs = [logits]
    for i in range(6, 16):  # decode the rest one token at a time
        logits, cache = step(im.weights, tokens[:, i : i + 1], cache, i)
        outs.append(logits)
    np.testing.assert_allclose(
        np.asarray(jnp.concatenate(outs, axis=1)), np.asarray(full), atol=atol, rtol=0
    )


def _greedy_reference(im, prompt, n):
    """Greedy continuation by re-running the full forward pass (no cache); the sequence is
    zero-padded on the right to a fixed length (causal: padding never changes earlier
    logits), so this compiles once."""
    seq = list(prompt)
    for _ in range(n):
        padded = np.zeros((1, 32), np.int64)
        padded[0, : len(seq)] = seq
        seq.append(int(np.argmax(np.asarray(im.logits(padded))[0, len(seq) - 1])))
    return seq[len(prompt) :]


@pytest.mark.slow
def test_generation_matches_full_forward_and_batching(packed32):
    prompts = [[5, 17, 99], list(range(30, 42))]
    gen = GenerationConfig(max_new_tokens=8)
    res = packed32.generate(prompts, gen)
    assert res.tokens.shape == (2, 8) and res.lengths.tolist() == [8, 8]
    for prompt, row in zip(prompts, res.rows(), strict=True):
        assert row == _greedy_reference(packed32, prompt, 8)
        # a row alone gives the same tokens as in the left-padded batch
        assert packed32.generate([prompt], gen).rows()[0] == row


def test_stop_tokens(packed32):
    prompt = [[1, 2, 3, 4]]
    free = packed32.generate(prompt, GenerationConfig(max_new_tokens=8)).rows()[0]
    stop = free[3]
    k = free.index(stop)
    res = packed32.generate(prompt, GenerationConfig(max_new_tokens=8, stop_tokens=(stop,)))
    assert res.rows()[0] == free[: k + 1] and bool(res.stopped[0])
    assert (res.tokens[0, k + 1 :] == -1).all()


def test_sampling_is_reproducible_and_filters(packed32):
    prompt = [[7, 8, 9]]
    cfg = GenerationConfig(max_new_tokens=8, temperature=1.5, top_k=50, top_p=0.95)
    a = packed32.generate(prompt, cfg, key=jax.random.key(3)).rows()
    b = packed32.generate(prompt, cfg, key=jax.random.key(3)).rows()
    c = packed32.generate(prompt, cfg, key=jax.random.key(4)).rows()
    assert a == b and a != c
    greedy = packed32.generate(prompt, GenerationConfig(max_new_tokens=8)).rows()
    # a nucleus this small keeps only the most likely token: greedy, whatever the key
    g = GenerationConfig(max_new_tokens=8, temperature=2.0, top_k=50, top_p=1e-6)
    assert packed32.generate(prompt, g, key=jax.random.key(5)).rows() == greedy
    with pytest.raises(ValueError, match="explicit key"):
        packed32.generate(prompt, cfg)


def test_sample_logits_distribution():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4000))
    keys = jax.random.key(0)
    draw = lambda **kw: np.asarray(sample_logits(logits, keys, temperature=1.0, **kw))
    assert set(draw(top_k=2).tolist()) == {0, 1}
    assert set(draw(top_p=0.7).tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.8
    assert set(draw(top_p=0.5).tolist()) == {0}
    freq = np.bincount(draw(), minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    assert np.asarray(sample_logits(logits[:1], None)).tolist() == [0]  # greedy


def test_generation_argument_errors(packed32):
    with pytest.raises(ValueError, match="max_seq_len=64"):
        packed32.generate([[1] * 60], GenerationConfig(max_new_tokens=8))
    with pytest.raises(ValueError, match="at least one token"):
        packed32.generate([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        packed32.generate([[300]])
    with pytest.raises(ValueError, match="top_p"):
        GenerationConfig(top_p=0.0)


def test_weights_stay_packed_and_memory_ratio(packed32):
    for lw in packed32.weights["layers"]:
        for name in ("attn.q_proj", "mlp.down_proj"):
            q = lw[name].weight
            assert q.data.dtype == jnp.uint8 and q.scales.dtype == ml_dtypes.float8_e4m3fn
            assert q.data.shape[1] * 2 == q.shape[1]
    st = packed32.memory_stats()
    assert st.packed_layers == 14 and st.dense_layers == 0
    assert st.expected_ratio == 4.5 / 16
    assert abs(st.ratio / (4.5 / 16) - 1) < 0.02  # measured from the arrays
    n = CFG.num_linear_params()
    assert st.quantized_bf16_bytes == 2 * n
    assert st.quantized_bytes == n // 2 + n // 16 + 4 * 14
    assert "ratio 0.28" in st.summary()


@pytest.mark.slow
def test_w4a4_emulation_and_calibration(model):
    tokens = _tokens(t=16)
    w4a16 = InferenceModel.from_params(model, CFG32, formats="nvfp4")
    amax = input_amax(model, tokens[None])  # the calibrator quantize and export share
    assert set(amax) == set(linear_paths(CFG)) and min(amax.values()) > 0
    # layers sharing an input see the same amax
    assert amax["layers.0.attn.q_proj"] == amax["layers.0.attn.k_proj"]
    static = InferenceModel.from_params(
        model, CFG32, formats="nvfp4", activations=True, input_amax=amax
    )
    dynamic = InferenceModel.from_params(model, CFG32, formats="nvfp4", activations=True)
    a, s, d = (np.asarray(m.logits(tokens)) for m in (w4a16, static, dynamic))
    assert 0 < np.abs(s - a).max() < 0.5 and 0 < np.abs(d - a).max() < 0.5
    assert static.weights["layers"][0]["attn.q_proj"].input_scale is not None


def test_evaluate_ppl_is_cross_entropy(packed32):
    batches = np.asarray(jax.random.randint(jax.random.key(2), (2, 3, 11), 0, 257))
    res = evaluate_ppl(packed32, batches)
    logits = np.concatenate([np.asarray(packed32.logits(b[:, :-1])) for b in batches])
    tgt = batches[:, :, 1:].reshape(-1, 10)
    logp = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), tgt[..., None], axis=-1).mean()
    assert res["tokens"] == 60
    assert res["nll"] == pytest.approx(float(nll), rel=1e-5)
    assert res["ppl"] == pytest.approx(float(np.exp(nll)), rel=1e-5)
