"""Scanned layers (``model.scan_layers``): each contiguous run of blocks with equal recipes
is one ``lax.scan``. The loss and every gradient equal the unrolled model's, the blocks of
other recipes keep theirs, the parameters keep their per-block names, and the compiled
program holds one block body per run, however deep the model.

The module runs on one xdist worker (``xdist_group``) so that a model's loss and gradients,
computed once (`_result`), serve every test that asks for the same model."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from microscale.model import ModelConfig, Transformer
from microscale.model.rules import PrecisionRules
from microscale.model.transformer import scan_segments

# inspected, never run: compiled as `plan` compiles (the HLO and memory do not depend on it)
from microscale.plan.compile import COMPILER_OPTIONS as INSPECT

pytestmark = pytest.mark.xdist_group("scan_layers")

TOKENS = jax.random.randint(jax.random.key(1), (2, 48), 0, 257)


def _model(n_layers=4, recipe="bf16", scan=False, first=1, last=1, **model):
    cfg = ModelConfig.tiny().replace(n_layers=n_layers, scan_layers=scan, **model)
    rules = (
        None
        if recipe == "bf16"
        else PrecisionRules.for_recipe(recipe, n_layers, bf16_first=first, bf16_last=last)
    )
    return Transformer(cfg, rngs=nnx.Rngs(0), rules=rules)


def _loss(model):
    logits = model(TOKENS[:, :-1], key=jax.random.key(3))
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, TOKENS[:, 1:, None], -1))


def _value_and_grads(model):
    loss, grads = nnx.jit(nnx.value_and_grad(_loss))(model)
    return float(loss), {
        "/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)
    }


@functools.cache
def _result(*args, **kwargs):
    """``_value_and_grads(_model(*args, **kwargs))``, computed once per model in this
    process (the tests only read it)."""
    return _value_and_grads(_model(*args, **kwargs))


@functools.cache
def _loss_only(*args, **kwargs):
    """The loss of ``_model(*args, **kwargs)``, forward only (a third of the compile of
    `_result`), for a model whose gradients no test reads."""
    return float(nnx.jit(_loss)(_model(*args, **kwargs)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe,remat,model",
    [
        ("bf16", "none", {}),
        ("bf16", "full", {}),
        ("nvfp4", "full", {}),  # stochastic rounding: each block's own stream, as unrolled
        ("nvfp4", "save_dots", {"attention_chunk": 16}),
        ("mxfp8", "minimal", {}),
        ("nvfp4", "none", {"attention_chunk": 8, "n_layers": 5}),
    ],
)
def test_scan_equals_unrolled(recipe, remat, model):
    """Loss and every parameter's gradient of the scanned model equal the unrolled one's
    (float tolerance; on XLA:CPU they agree to the bit). Four blocks: with the bf16 first
    and last, a quantized run of two is scanned."""
    model = dict(model)
    n = model.pop("n_layers", 4)
    ref = _result(n, recipe, remat=remat, **model)
    got = _result(n, recipe, scan=True, remat=remat, **model)
    assert got[0] == pytest.approx(ref[0], rel=1e-6)
    assert got[1].keys() == ref[1].keys()
    for name, g in ref[1].items():
        scale = float(np.max(np.abs(g))) or 1.0
        err = float(np.max(np.abs(got[1][name] - g))) / scale
        assert err <= 1e-5, (name, err)


@pytest.mark.parametrize(
    "recipe,n,first,last,segments",
    [
        ("bf16", 5, 0, 0, [[0, 1, 2, 3, 4]]),
        ("nvfp4", 5, 1, 1, [[0], [1, 2, 3], [4]]),
        ("nvfp4", 6, 0, 2, [[0, 1, 2, 3], [4, 5]]),
        ("nvfp4", 3, 1, 1, [[0], [1], [2]]),
        ("mxfp4", 4, 2, 0, [[0, 1], [2, 3]]),
    ],
)
def test_segments_are_the_runs_of_equal_recipes(recipe, n, first, last, segments):
    assert scan_segments(_model(n, recipe, first=first, last=last).layers) == segments


@pytest.mark.slow
def test_mixed_segments_keep_their_recipes():
    """Per-layer rules that split the blocks into runs: the scanned model equals the
    unrolled one, and differs from the all-bf16 model (the NVFP4 run really quantizes) and
    from all-NVFP4 (the bf16 ends really stay bf16). The models of
    ``test_scan_equals_unrolled``'s ``full`` rows, computed once (`_result`); all-NVFP4's
    loss forward only (`_loss_only`: no gradient is read)."""
    mixed = _result(4, "nvfp4", scan=True, remat="full")[0]
    assert mixed == pytest.approx(_result(4, "nvfp4", remat="full")[0], rel=1e-6)
    bf16 = _result(4, "bf16", scan=True, remat="full")[0]
    every = _loss_only(4, "nvfp4", scan=True, first=0, last=0, remat="full")
    assert abs(mixed - bf16) > 1e-5 and abs(mixed - every) > 1e-5


def test_parameter_names_do_not_change():
    """Checkpoints, export, PTQ and ``init_from`` see the same per-block names."""
    paths = [
        sorted(
            "/".join(map(str, p))
            for p, _ in nnx.to_flat_state(nnx.state(_model(3, scan=s), nnx.Param))
        )
        for s in (False, True)
    ]
    assert paths[0] == paths[1] and "layers/2/mlp/down_proj/kernel" in paths[0]


def _compiled_dots(n_layers, scan):
    model = _model(n_layers, scan=scan, remat="full")
    graphdef, state = nnx.split(model)

    def step(state):
        return jax.grad(lambda s: _loss(nnx.merge(graphdef, s)))(state)

    text = jax.jit(step).lower(state).compile(compiler_options=INSPECT).as_text()
    return len(re.findall(r"\bdot\(", text))


@pytest.mark.slow
def test_program_size_does_not_grow_with_depth():
    """The compiled train step of a scanned model has as many GEMMs at 8 blocks as at 2 (one
    body per run); unrolled, they grow with the depth."""
    scanned = [_compiled_dots(n, True) for n in (2, 8)]
    unrolled = [_compiled_dots(n, False) for n in (2, 8)]
    assert scanned[0] == scanned[1] > 0
    assert unrolled[1] > 3 * unrolled[0]
