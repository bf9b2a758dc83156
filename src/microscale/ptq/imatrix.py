"""The importance matrix llama.cpp's quantizer weights rounding errors by, measured on
microscale's calibration batches: per block linear layer, the sum over the tokens of each
input column's square (llama.cpp's ``llama-imatrix`` measures the same by running the
model). :func:`collect_imatrix` returns it by layer path; a layout that stores it writes it
(``Layout.imatrix``; GGUF: :func:`microscale.export.gguf.imatrix.write_imatrix`).

    >>> im = collect_imatrix(model, batches)  # doctest: +SKIP
    >>> write_imatrix("imatrix.gguf", im, datasets=["stdlib"])  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from microscale.ptq.tap import intercept_linears, tappable_paths, without_remat

__all__ = ["Imatrix", "collect_imatrix"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Imatrix:
    """Sums of squared inputs of a model's block linears, by layer path."""

    # linear layer path (``layers.0.attn.q_proj``) -> float64 [K]: sum over the tokens of
    # each input column's square
    in_sum2: Mapping[str, np.ndarray]
    # Tokens summed (every layer sees every token of the batches).
    tokens: int
    # Calibration sequences and the tokens of each (llama.cpp's chunk count and size).
    sequences: int
    seq_len: int

    def mean_sq(self) -> dict[str, np.ndarray]:
        """The importance weights ``quantize_ggml`` takes: ``in_sum2 / tokens`` per layer, in
        float32 as ``llama-quantize --imatrix`` computes them from the file (float32 sums
        over a float32 count), so both encode with the same weights."""
        n = np.float32(self.tokens)
        return {k: np.asarray(v, np.float32) / n for k, v in self.in_sum2.items()}


def collect_imatrix(model: Any, batches: Iterable[Any]) -> Imatrix:
    """Run ``model`` (an NNX model; untouched: a private copy is run, block remat off) on
    each ``[B, T]`` token batch (inputs ``tokens[:, :-1]``, as the PTQ engine's loss
    reads them) and sum every block linear's squared input per column, in float64 across
    batches. Layers outside the blocks (the LM head) are left out, as ``llama-imatrix``
    leaves out ``output.weight`` by default."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    work = nnx.merge(graphdef, params, rest)
    without_remat(work)
    paths = [p for p in tappable_paths(work) if p.startswith("layers.")]
    if not paths:
        raise ValueError("collect_imatrix: the model has no block linear layers")
    graphdef, params, rest = nnx.split(work, nnx.Param, ...)  # type: ignore[misc]

    @jax.jit
    def sums(params, tokens):
        m = nnx.merge(graphdef, params, rest)
        seen = {}

        def hook(path, call, x):
            x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
            seen[path] = jnp.sum(x2 * x2, axis=0)
            return call(x)

        with intercept_linears(m, hook, paths=set(paths)):
            m(tokens[:, :-1])
        return seen

    acc: dict[str, np.ndarray] = {}
    tokens = sequences = seq_len = 0
    for batch in batches:
        b = np.asarray(batch)
        if b.ndim != 2 or b.shape[1] < 2:
            raise ValueError(f"collect_imatrix: a batch of shape {b.shape}; expected [B, T >= 2]")
        got = sums(params, jnp.asarray(b))
        for p in paths:
            acc[p] = acc.get(p, 0.0) + np.asarray(got[p], np.float64)
        tokens += b.shape[0] * (b.shape[1] - 1)
        sequences += b.shape[0]
        seq_len = b.shape[1] - 1
    if not tokens:
        raise ValueError("collect_imatrix: no calibration batches")
    return Imatrix(
        in_sum2={p: acc[p] for p in paths},
        tokens=tokens,
        sequences=sequences,
        seq_len=seq_len,
    )
