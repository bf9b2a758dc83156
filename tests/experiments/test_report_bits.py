"""weight_bits_per_param reads a run's own allocation when it chose one (nvfp4_adaptive)."""

import math

import jax
import pytest

from microscale.experiments.report import weight_bits_per_param
from microscale.model import Transformer, iter_linears
from microscale.train import TrainConfig


def test_bits_follow_the_recorded_allocation():
    from flax import nnx

    cfg = TrainConfig(recipe="nvfp4")
    model = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    paths = [p for p, _ in iter_linears(model)]
    positional = weight_bits_per_param(cfg)
    assert weight_bits_per_param(cfg, dict.fromkeys(paths, "bf16")) == 16.0
    one = {p: ("bf16" if p == paths[0] else "nvfp4") for p in paths}
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    n0 = math.prod(dict(iter_linears(model))[paths[0]].kernel.shape)
    n_lin = sum(math.prod(m.kernel.shape) for _, m in iter_linears(model))
    # by hand: every parameter at 16 bits, minus 11.5 bits for each NVFP4 weight element
    assert weight_bits_per_param(cfg, one) == pytest.approx(16.0 - 11.5 * (n_lin - n0) / total)
    assert weight_bits_per_param(cfg, one) != positional
