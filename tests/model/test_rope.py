"""RoPE frequencies (microscale.model.rope) against transformers' own ``ROPE_INIT_FUNCTIONS``,
the default table bit for bit as before, and the refusals.

Tolerance against transformers, per inverse frequency ``ω'_i``: 8 float32 ulp of it, plus
one ulp of 1 times the default ``ω_i``. Both compute in float32 from the same formulas;
XLA's ``pow`` and torch's differ by up to 1 ulp (``θ^(−e)`` here, ``1 / θ^e`` there), and
the blends add a few roundings in another order (at most 4 ulp over this table). The
second term is the share kept, ``k_i = 1 − ramp_i`` for yarn: a one-ulp difference in
the ramp (XLA divides by a constant as a multiplication by its reciprocal, torch divides)
becomes an absolute difference of up to one ulp of 1 in ``k_i``, so of ``2^-23 ω_i`` in
``ω'_i`` (measured: 12 ulp of ``ω'_i`` where ``k_i`` is small; there the float64 value is
within 0.5 ulp of microscale's).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from microscale.model import ModelConfig, RopeScaling, rope_tables
from microscale.model.rope import ROPE_KINDS, inverse_frequencies

ULP = 8

HEAD_DIMS = (16, 64, 128)
THETAS = (500.0, 10000.0, 500000.0)
# (transformers' rope dict, max_position_embeddings, microscale's RopeScaling)
CASES = [
    ({"rope_type": "linear", "factor": 4.0}, 64, RopeScaling(kind="linear", factor=4.0)),
    ({"rope_type": "linear", "factor": 1.5}, 64, RopeScaling(kind="linear", factor=1.5)),
    (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        131072,
        RopeScaling(kind="llama3", factor=8.0, original_max_position_embeddings=8192),
    ),
    (
        {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        64,
        RopeScaling(kind="llama3", factor=32.0, original_max_position_embeddings=16),
    ),
    (
        {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 0.5,
            "high_freq_factor": 2.0,
            "original_max_position_embeddings": 64,
        },
        256,
        RopeScaling(
            kind="llama3",
            factor=4.0,
            low_freq_factor=0.5,
            high_freq_factor=2.0,
            original_max_position_embeddings=64,
        ),
    ),
    (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
        16384,
        RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=4096),
    ),
    (
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 8.0,
            "beta_slow": 2.0,
            "truncate": False,
        },
        128,
        RopeScaling(
            kind="yarn",
            factor=8.0,
            original_max_position_embeddings=16,
            beta_fast=8.0,
            beta_slow=2.0,
            truncate=False,
        ),
    ),
    (
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        163840,
        RopeScaling(
            kind="yarn",
            factor=40.0,
            original_max_position_embeddings=4096,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
    ),
    (
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 32,
            "attention_factor": 1.25,
        },
        64,
        RopeScaling(
            kind="yarn", factor=2.0, original_max_position_embeddings=32, attention_factor=1.25
        ),
    ),
]


def _hf(rope: dict, context: int, head_dim: int, theta: float, seq_len=None):
    transformers = pytest.importorskip("transformers", exc_type=ImportError)
    torch = pytest.importorskip("torch", exc_type=ImportError)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=context,
        rope_parameters={**rope, "rope_theta": theta},
    )
    n = None if seq_len is None else torch.tensor(seq_len)
    inv_freq, m = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu", seq_len=n)
    return inv_freq.numpy(), m


def _assert_close(got, ref, head_dim: int, theta: float):
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.dtype == ref.dtype == np.float32 and got.shape == ref.shape
    omega = theta ** (-np.arange(head_dim // 2) * 2.0 / head_dim)
    bound = ULP * np.spacing(np.abs(ref)) + 2.0**-23 * omega
    err = np.abs(got.astype(np.float64) - ref)
    assert (err <= bound).all(), (err / bound).max()


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("theta", THETAS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[2].kind)
def test_static_kinds_equal_transformers(case, theta, head_dim):
    rope, context, sc = case
    ref, ref_m = _hf(rope, context, head_dim, theta)
    got, m = inverse_frequencies(head_dim, theta, sc)
    _assert_close(got, ref, head_dim, theta)
    assert m == pytest.approx(ref_m, rel=1e-12)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("theta", THETAS)
@pytest.mark.parametrize("factor", [2.0, 4.0])
@pytest.mark.parametrize("length", [None, 5, 16, 17, 48, 1000])
def test_dynamic_equals_transformers_below_and_above_the_original_length(
    length, factor, theta, head_dim
):
    """transformers' L is max_position_embeddings (16 here); at and below it the table is
    the default one, above it the base grows with the length."""
    ref, _ = _hf({"rope_type": "dynamic", "factor": factor}, 16, head_dim, theta, length)
    sc = RopeScaling(kind="dynamic", factor=factor, original_max_position_embeddings=16)
    got, m = inverse_frequencies(head_dim, theta, sc, None if length is None else jnp.int32(length))
    _assert_close(got, ref, head_dim, theta)
    assert m == 1.0
    default, _ = inverse_frequencies(head_dim, theta)
    if length is None or length <= 16:
        np.testing.assert_array_equal(got, default)
    else:
        assert (np.asarray(got)[1:] < np.asarray(default)[1:]).all()


def test_dynamic_reads_the_length_of_the_call_from_its_positions():
    sc = RopeScaling(kind="dynamic", factor=4.0, original_max_position_embeddings=16)
    pos = jnp.array([[0, 1, 2], [30, 31, 47]])
    cos, sin = rope_tables(pos, 32, 10000.0, sc)
    inv, _ = inverse_frequencies(32, 10000.0, sc, 48)
    angles = np.asarray(pos, np.float32)[..., None] * np.asarray(inv)
    np.testing.assert_array_equal(np.asarray(cos), np.asarray(jnp.cos(jnp.asarray(angles))))
    short, _ = rope_tables(jnp.arange(10), 32, 10000.0, sc)
    np.testing.assert_array_equal(short, rope_tables(jnp.arange(10), 32, 10000.0)[0])


def _old_rope_tables(positions, head_dim, theta):
    """rope_tables as it was before RoPE scaling (the default RoPE), written out again."""
    half = head_dim // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / head_dim)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("theta", THETAS)
@pytest.mark.parametrize("scaling", [None, RopeScaling()], ids=["none", "kind-default"])
def test_default_tables_are_the_old_ones_bit_for_bit(scaling, theta, head_dim):
    pos = jnp.arange(4096).reshape(2, 2048)
    for got, want in zip(
        rope_tables(pos, head_dim, theta, scaling),
        _old_rope_tables(pos, head_dim, theta),
        strict=True,
    ):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_yarn_multiplies_cos_and_sin_by_its_attention_factor():
    sc = RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=16)
    cos, sin = rope_tables(jnp.arange(40), 32, 500.0, sc)
    inv, m = inverse_frequencies(32, 500.0, sc)
    assert m == pytest.approx(1 + 0.1 * np.log(4.0))
    angles = jnp.arange(40, dtype=jnp.float32)[:, None] * inv
    np.testing.assert_array_equal(np.asarray(cos), np.asarray(jnp.cos(angles) * m))
    np.testing.assert_array_equal(np.asarray(sin), np.asarray(jnp.sin(angles) * m))


def test_every_kind_names_only_fields_of_rope_scaling():
    names = {f.name for f in dataclasses.fields(RopeScaling)}
    for kind, row in ROPE_KINDS.items():
        assert set(row.fields) <= names - {"kind"}, kind
        assert (row.keep is None) != (row.base is None), kind


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="longrope"), "RopeScaling.kind='longrope': expected one of"),
        (dict(kind="LLAMA3"), "RopeScaling.kind='LLAMA3'"),
        (dict(kind="linear", factor=0.5), "RopeScaling.factor=0.5: expected a number >= 1"),
        (dict(kind="linear", factor=float("nan")), "RopeScaling.factor=nan"),
        (dict(kind="linear", factor=True), "RopeScaling.factor=True"),
        (dict(kind="linear", factor="2"), "RopeScaling.factor='2'"),
        (dict(kind="linear", low_freq_factor=2.0), "low_freq_factor=2.0 is not read by kind"),
        (dict(kind="default", factor=2.0), "RopeScaling.factor=2.0 is not read by kind 'default'"),
        (dict(kind="llama3", factor=8.0), "original_max_position_embeddings=None: expected a"),
        (
            dict(kind="llama3", factor=8.0, original_max_position_embeddings=8192.5),
            "original_max_position_embeddings=8192.5",
        ),
        (
            dict(
                kind="llama3",
                factor=8.0,
                original_max_position_embeddings=8192,
                low_freq_factor=4.0,
                high_freq_factor=1.0,
            ),
            "RopeScaling.high_freq_factor=1.0: expected more than low_freq_factor=4.0",
        ),
        (
            dict(kind="llama3", factor=8, original_max_position_embeddings=64, low_freq_factor=0),
            "RopeScaling.low_freq_factor=0: expected a number > 0",
        ),
        (
            dict(kind="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=1.0),
            "RopeScaling.beta_fast=1.0: expected more than beta_slow=1.0",
        ),
        (
            dict(kind="yarn", factor=4.0, original_max_position_embeddings=64, mscale=-1.0),
            "RopeScaling.mscale=-1.0: expected a number > 0 or none",
        ),
        (
            dict(kind="yarn", factor=4.0, original_max_position_embeddings=64, truncate=1),
            "RopeScaling.truncate=1: expected true or false",
        ),
        (
            dict(kind="dynamic", factor=2.0, original_max_position_embeddings=0),
            "RopeScaling.original_max_position_embeddings=0: expected a positive int",
        ),
    ],
)
def test_refusals_name_the_field_and_its_value(kwargs, message):
    with pytest.raises(ValueError, match=None) as e:
        RopeScaling(**kwargs)
    assert message in str(e.value)


def test_model_config_reads_and_writes_rope_scaling():
    sc = RopeScaling(kind="llama3", factor=8, original_max_position_embeddings=8192)
    cfg = ModelConfig(rope_scaling=sc)
    assert cfg.rope_scaling.factor == 8.0 and isinstance(cfg.rope_scaling.factor, float)
    d = cfg.to_dict()
    assert d["rope_scaling"]["kind"] == "llama3"
    assert ModelConfig.from_dict(d) == cfg
    assert ModelConfig(rope_scaling=RopeScaling()).rope_scaling is None  # one default
    with pytest.raises(ValueError, match="RopeScaling: unknown key"):
        ModelConfig.from_dict({"rope_scaling": {"kind": "linear", "factr": 2.0}})
    with pytest.raises(TypeError, match="ModelConfig.rope_scaling='llama3'"):
        ModelConfig.from_dict({"rope_scaling": "llama3"})
    with pytest.raises(ValueError, match="expected a RopeScaling or none"):
        ModelConfig(rope_scaling={"kind": "linear"})


@pytest.mark.parametrize(
    "name, factor", [("llama-1b", 32.0), ("llama-8b", 8.0), ("llama-70b", 8.0)]
)
def test_llama_presets_have_llama3_rope(name, factor):
    cfg = ModelConfig.preset(name)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling(
        kind="llama3",
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    assert ModelConfig.preset("tiny").rope_scaling is None
