"""The chunked LM head + loss (``model.loss_chunk``) against the whole-sequence one.

Per-token losses are the same computation; what differs is float rounding: the order of
the final sum (loss), and the backward pass's recomputation of each chunk's logits
(``jax.checkpoint``), which XLA may compile with other summation orders than the forward.
Both orders are the CPU kernel's choice, so the bounds come from the arithmetic, not from
one machine (measured values per CPU kind and XLA:CPU variant: docs/testing/tolerances.md).
``u = 2^-24`` (float32), ``n = B * T = 160`` positions, ``V = 300`` logits per position,
``gamma(k) = k u / (1 - k u)`` (Higham, *Accuracy and Stability of Numerical Algorithms*,
eq. 3.8: a sum of ``k + 1`` terms in any order errs by at most ``gamma(k)`` times the sum of
their magnitudes).

* Loss (every recipe): the mean of ``n`` positive per-token losses, summed in two orders
  (at most ``2 gamma(n)`` relative), each token's log-sum-exp over ``V`` logits recomputed in
  another order (at most ``gamma(V)`` absolute per token, so relative to a loss above 1 nat,
  asserted): ``2 gamma(n) + gamma(V)``, 3.7e-5.
* Gradients, float32 compute: no rounding to a narrower type anywhere; the programs differ
  only in summation order, the longest sum being the LM head's gradient over the ``n``
  positions (per chunk, then across chunks). Bound ``2 gamma(n)`` relative to the largest
  gradient, 1.9e-5 (at initialisation the target tokens' ``-1/n`` terms dominate the largest
  gradients, so the sum of magnitudes is within a small factor of the largest gradient).
* Gradients, bf16 compute: the bf16 recipe rounds the logits' float32 gradient to bfloat16
  before the head's dgrad and wgrad GEMMs (and every activation gradient before the
  blocks' GEMMs). Where the two programs' float32 values straddle a bfloat16 rounding
  boundary they round to adjacent bfloat16 values: one element moves by one bfloat16 ulp,
  at most ``2^-7`` of itself (8 significant bits). The largest such element is a target
  token's ``-1/n`` term of the largest gradient, so one flip moves a gradient by at most
  ``2^-7`` of the largest gradient, and carried back through the network (whose Jacobian at
  initialisation does not amplify) no more: bound ``2^-7`` = 7.8e-3. A flip needs the two
  float32 values on either side of a boundary, so whether one happens, and where, is the
  CPU kernel's choice: 0 to 1.6e-3 measured, over the CPU kinds and variants.
* NVFP4: the same bfloat16 flips enter the block GEMMs' quantized operands, where a flip
  can also move an E2M1 rounding (one FP4 step, up to 1/3 of its block's amax) of one
  element. The chance is the float32 difference over the step (about ``2^-20``) per
  element; over this model's ~1e5 operand elements none is expected, and none was seen:
  the bf16 bound holds, measured up to 2.3e-4 (docs/testing/tolerances.md).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from microscale.model import ModelConfig, PrecisionRules, Transformer

# inspected, never run: compiled as `plan` compiles (the HLO and memory do not depend on it)
from microscale.plan.compile import COMPILER_OPTIONS as INSPECT
from microscale.train.step import lm_loss

T = 40  # positions per window (inputs); chunks of 1, 7 and T - 1 leave a partial last chunk


def _model(tie: bool, recipe: str, compute_dtype: str = "bfloat16"):
    """One block: every claim here is about the head and the loss, and one block carries
    their gradient back through quantized GEMMs as two did, at less compile
    (benchmarks/timings.md)."""
    cfg = ModelConfig(
        vocab_size=300,
        d_model=64,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        d_ff=128,
        max_seq_len=64,
        tie_embeddings=tie,
        dim_multiple=16,
        compute_dtype=compute_dtype,
    )
    rules = None if recipe == "bf16" else PrecisionRules(default=recipe)
    return cfg, Transformer(cfg, rngs=nnx.Rngs(0), rules=rules)


def _lowered(model, cfg, chunk, tokens):
    """The fwd+bwd program of the loss with ``loss_chunk=chunk``, lowered (not compiled),
    and the parameters it takes."""
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def f(p):
        m = nnx.merge(graph, p, rest)
        m.config = dataclasses.replace(cfg, loss_chunk=chunk)
        return lm_loss(m, tokens, jax.random.key(3))

    return jax.jit(jax.value_and_grad(f)).lower(params), params


def _program(lowered) -> str:
    """The lowered program's text, its sharding-group ids (labels numbered by a counter
    global to the process) renumbered in order of first use."""
    ids: dict[str, str] = {}
    return re.sub(
        r"group_id=(\d+)",
        lambda m: "group_id=" + ids.setdefault(m[1], str(len(ids))),
        lowered.as_text(),
    )


def _run(lowered, params):
    loss, grads = lowered.compile()(params)
    return float(loss), [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]


def _loss_and_grads(model, cfg, chunk, tokens):
    return _run(*_lowered(model, cfg, chunk, tokens))


B = 4  # windows per batch


def _gamma(k: int) -> float:
    """Higham's gamma_k for float32: the relative error bound of a k + 1 term sum."""
    u = 2.0**-24
    return k * u / (1 - k * u)


@pytest.mark.slow
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize(
    "recipe,compute", [("bf16", "float32"), ("bf16", "bfloat16"), ("nvfp4", "bfloat16")]
)
def test_chunked_loss_equals_the_whole_sequence_loss(tie, recipe, compute):
    cfg, model = _model(tie, recipe, compute)
    tokens = jax.random.randint(jax.random.key(1), (B, T + 1), 0, cfg.vocab_size)
    whole, params = _lowered(model, cfg, 0, tokens)
    loss0, g0 = _run(whole, params)
    assert loss0 > 1.0  # the loss bound's gamma(V) is absolute per token (docstring)
    n = B * T
    loss_bound = 2 * _gamma(n) + _gamma(cfg.vocab_size)
    grad_bound = 2 * _gamma(n) if compute == "float32" else 2.0**-7
    scale = max(np.abs(g).max() for g in g0)
    for chunk in (1, 7, T - 1):
        loss, g = _loss_and_grads(model, cfg, chunk, tokens)
        assert abs(loss - loss0) <= loss_bound * loss0, (chunk, loss, loss0)
        err = max(np.abs(a - b).max() for a, b in zip(g0, g, strict=True)) / scale
        assert err <= grad_bound, (chunk, err, grad_bound)
    # One chunk (chunk >= T) is the whole-sequence program itself: the same lowered
    # program, so the same compiled one and the same loss and gradients to the bit, held
    # without compiling it twice more.
    for chunk in (T, T + 5):
        assert _program(_lowered(model, cfg, chunk, tokens)[0]) == _program(whole), chunk


def test_chunks_need_not_divide_the_sequence_and_keep_the_gradient_finite():
    cfg, model = _model(False, "bf16")
    tokens = jax.random.randint(jax.random.key(2), (2, 11), 0, cfg.vocab_size)
    loss, g = _loss_and_grads(model, cfg, 4, tokens)  # chunks 4 + 4 + 2 (+2 masked)
    assert np.isfinite(loss) and all(np.isfinite(x).all() for x in g)


@pytest.mark.slow
def test_chunked_loss_holds_one_chunk_of_logits():
    """The compiled fwd+bwd's temporary bytes: whole-sequence logits and their gradient
    (float32 [4, 512, 8192]: 64 MiB each) are gone with 64-position chunks."""
    cfg = ModelConfig(
        vocab_size=8192, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=128, max_seq_len=512
    )
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jnp.zeros((4, 513), jnp.int32)

    def temp(chunk):
        def f(p):
            m = nnx.merge(graph, p, rest)
            m.config = dataclasses.replace(cfg, loss_chunk=chunk)
            return lm_loss(m, tokens)

        c = jax.jit(jax.value_and_grad(f)).lower(params).compile(compiler_options=INSPECT)
        return c.memory_analysis().temp_size_in_bytes

    whole, chunked = temp(0), temp(64)
    logits = 4 * 512 * 8192 * 4
    assert whole >= logits  # the whole-sequence program holds at least one copy
    assert chunked < whole - logits, (whole, chunked)


def test_loss_chunk_is_validated():
    for bad in (-1, 1.5, True, 2**25):
        with pytest.raises(ValueError, match="loss_chunk"):
            ModelConfig(loss_chunk=bad)


SHARDED = """
import dataclasses, json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from microscale.model import ModelConfig, Transformer
from microscale.model.sharding import activation_sharding
from microscale.train.step import lm_loss
mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                     axis_types=(jax.sharding.AxisType.Auto,) * 3)
out = {}
for tie in (True, False):
    cfg = ModelConfig(vocab_size=320, d_model=64, n_layers=2, n_heads=2, n_kv_heads=2,
                      d_ff=128, max_seq_len=64, tie_embeddings=tie)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(1), (8, 41), 0, 320)

    def f(p, chunk, m):
        mm = nnx.merge(graph, p, rest)
        mm.config = dataclasses.replace(cfg, loss_chunk=chunk)
        with activation_sharding(m):
            return lm_loss(mm, tokens)

    l0, g0 = jax.jit(jax.value_and_grad(lambda p: f(p, 0, None)))(params)
    tok_sh = NamedSharding(mesh, P(("data", "fsdp")))
    tokens = jax.device_put(tokens, tok_sh)
    l1, g1 = jax.jit(jax.value_and_grad(lambda p: f(p, 16, mesh)))(params)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g0))
    err = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)))
    out[str(tie)] = [float(l0), float(l1), err / scale]
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_chunked_loss_on_8_devices_equals_one_device(fake_devices):
    """data 2 x fsdp 2 x tensor 2: each data-parallel device sums its own rows' chunks
    (shard_map over the batch axes) and the head's gradient is reduced once; loss and
    gradients equal the one-device whole-sequence loss within float rounding. Gradients:
    within a bfloat16 rounding of the residual stream's gradient (measured 3.4e-3 of the
    largest, in the embedding's), because the tensor-parallel step sums q/k/v's (and
    gate/up's) input gradients in float32 and rounds once, as Megatron's fused GEMM does
    (``model.tensor_parallel``), where one device rounds each projection's to bfloat16 and
    sums those."""
    import json

    out = fake_devices(SHARDED)
    res = json.loads(next(x for x in out.splitlines() if x.startswith("RESULT"))[6:])
    for tie, (l0, l1, err) in res.items():
        assert abs(l0 - l1) <= 1e-5 * l0, (tie, l0, l1)
        assert err <= 5e-3, (tie, err)
