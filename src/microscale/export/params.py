"""Flat parameter dictionaries: ``{"layers.0.attn.q_proj.kernel": array, ...}``.

Everything in ``microscale.export`` and ``microscale.inference`` works on this one flat
form (the same dotted paths as the model's parameters and the precision rules). It can
be built from a ``Transformer``, an ``nnx.State`` of its params, the nested pure dict of
one (``state.to_pure_dict()``) or given directly; values may be jax/numpy arrays or, for a
linear kernel, an already quantized ``QArray``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from microscale.export.hf import param_shapes
from microscale.formats import QArray
from microscale.model import ModelConfig

__all__ = ["check_params", "flat_params"]


def _flatten(prefix: str, tree: Any, out: dict[str, Any]) -> None:
    if isinstance(tree, Mapping) and not isinstance(tree, QArray):
        for k, v in tree.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = tree


def flat_params(source: Any) -> dict[str, Any]:
    """{dotted parameter path: value} from a model, an ``nnx.State``, a nested or flat dict."""
    if isinstance(source, nnx.Module):
        source = nnx.state(source, nnx.Param)
    if isinstance(source, nnx.State):
        out = {".".join(str(p) for p in path): v for path, v in nnx.to_flat_state(source)}
    elif isinstance(source, Mapping):
        out = {}
        _flatten("", source, out)
    else:
        raise TypeError(
            f"params of type {type(source).__name__}: expected a Transformer, an "
            "nnx.State, or a (nested or flat) dict of arrays"
        )
    return {k: (v[...] if isinstance(v, nnx.Variable) else v) for k, v in out.items()}


def check_params(params: Mapping[str, Any], cfg: ModelConfig) -> None:
    """Every parameter of ``Transformer(cfg)`` present with its shape; nothing else.
    Linear kernels may be QArrays (in kernel ``(K, N)`` or HF ``(N, K)`` orientation)."""
    want = param_shapes(cfg)
    extra = sorted(set(params) - set(want))
    if extra:
        raise ValueError(
            f"parameter {extra[0]!r} is not part of a model with this config "
            f"(expected names like {next(iter(want))!r})"
        )
    for name, shape in want.items():
        if name not in params:
            raise ValueError(f"parameter {name!r} is missing (expected shape {shape})")
        v = params[name]
        if isinstance(v, QArray):
            got = tuple(v.shape) if v.axis == 0 else tuple(reversed(v.shape))
            if len(v.shape) != 2 or got != shape:
                raise ValueError(
                    f"parameter {name!r}: QArray of shape {v.shape} (axis "
                    f"{v.axis}); expected {shape} with axis 0 or "
                    f"{shape[::-1]} with axis 1"
                )
            continue
        got = tuple(np.shape(v))
        if got != shape:
            raise ValueError(f"parameter {name!r} has shape {got}; expected {shape}")
        dtype = getattr(v, "dtype", None) or np.asarray(v).dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"parameter {name!r} has dtype {dtype}; expected a float dtype")
