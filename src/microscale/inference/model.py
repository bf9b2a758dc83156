"""``InferenceModel``: load, generate, evaluate and measure a (packed) model.

Sources (``load_model(path)`` picks by what the folder holds):

* an exported HF-style folder (``config.json``: plain HF, compressed-tensors or ModelOpt)
  -- quantized layers stay packed exactly as stored;
* a microscale training run folder (``config.yaml`` + ``checkpoints/``) -- float weights,
  optionally quantized in memory with ``formats=`` (the same per-layer formats, fused
  groups and scales ``export_checkpoint`` would write).

Memory (``memory_stats``) is measured from the arrays actually held: for every packed
layer the bytes of its codes, block scales and tensor scale, against 2 bytes per weight
for BF16. NVFP4 gives ``(K/2 + K/16) N + 4`` bytes for ``2 K N``: ``4.5/16`` of BF16.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from microscale.data import check_vocab_fits
from microscale.export.layouts import (
    LayerFormats,
    LayerQuant,
    input_decode_scales,
    quantize_linear_weights,
    resolve_layers,
)
from microscale.export.params import check_params, flat_params
from microscale.export.reader import Checkpoint, read_checkpoint
from microscale.export.registry import Layout, detect
from microscale.formats import QArray
from microscale.inference.engine import Linear, build_weights, forward, init_cache
from microscale.inference.sampling import GenerationConfig, sample_logits
from microscale.model import ModelConfig, linear_paths
from microscale.ops.loss import token_nll
from microscale.outputs import TrainingRun

__all__ = [
    "GenerationResult",
    "InferenceModel",
    "MemoryStats",
    "evaluate_ppl",
    "load_model",
]

_PROMPT_BUCKET = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationResult:
    """Output of :meth:`InferenceModel.generate`."""

    # int32 [B, max_new_tokens]: generated ids, -1 after a row's end.
    tokens: np.ndarray
    # Generated tokens per row (a stop token counts and is included).
    lengths: np.ndarray
    # Whether each row ended on a stop token (else it hit max_new_tokens).
    stopped: np.ndarray

    def rows(self) -> list[list[int]]:
        """The generated ids of each row, without padding."""
        return [self.tokens[i, : int(n)].tolist() for i, n in enumerate(self.lengths)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryStats:
    """Resident bytes of the model's weights, measured from the arrays held."""

    # Bytes of the packed (quantized) linear layers: codes + block scales + tensor scales.
    quantized_bytes: int
    # What those same layers take in BF16 (2 bytes per weight).
    quantized_bf16_bytes: int
    # Expected quantized / BF16 ratio from the formats' bits per element (NVFP4: 4.5/16).
    expected_ratio: float
    # Bytes of unquantized linear layers.
    dense_linear_bytes: int
    # Embeddings, norms and LM head.
    other_bytes: int
    # Number of packed / dense linear layers.
    packed_layers: int
    dense_layers: int

    @property
    def ratio(self) -> float:
        """quantized_bytes / quantized_bf16_bytes (nan without packed layers)."""
        return (
            self.quantized_bytes / self.quantized_bf16_bytes
            if self.quantized_bf16_bytes
            else float("nan")
        )

    @property
    def total_bytes(self) -> int:
        return self.quantized_bytes + self.dense_linear_bytes + self.other_bytes

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(ratio=self.ratio, total_bytes=self.total_bytes)
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}

    def summary(self) -> str:
        if not self.packed_layers:
            return (
                f"weights: {self.total_bytes / 2**20:.2f} MiB, {self.dense_layers} dense "
                "linear layers, none packed"
            )
        dev = (self.ratio / self.expected_ratio - 1) * 100
        return (
            f"packed linear layers: {self.packed_layers}, "
            f"{self.quantized_bytes / 2**20:.3f} MiB resident vs "
            f"{self.quantized_bf16_bytes / 2**20:.3f} MiB in BF16: ratio "
            f"{self.ratio:.4f} (formats' bits/16: {self.expected_ratio:.4f}, {dev:+.2f}%); "
            f"dense linear {self.dense_linear_bytes / 2**20:.3f} MiB, other "
            f"{self.other_bytes / 2**20:.3f} MiB, total {self.total_bytes / 2**20:.3f} MiB"
        )


def _nbytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


class InferenceModel:
    """A model ready for generation and evaluation (weights packed where quantized)."""

    def __init__(
        self,
        weights: dict[str, Any],
        config: ModelConfig,
        *,
        layers: Mapping[str, LayerQuant],
        tokenizer: Any = None,
        compute_dtype: Any = None,
        source: str = "",
    ):
        self.weights = weights
        self.config = config
        self.layers = dict(layers)
        if tokenizer is not None:
            check_vocab_fits(
                tokenizer.vocab_size,
                config.vocab_size,
                what=f"the tokenizer of {source or 'the model'}",
            )
        self.tokenizer = tokenizer
        self.compute_dtype = jnp.dtype(compute_dtype or config.compute_dtype)
        self.source = source

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_params(
        cls,
        params: Any,
        config: ModelConfig,
        *,
        formats: LayerFormats = None,
        activations: bool = False,
        input_amax: Mapping[str, Any] | None = None,
        tokenizer: Any = None,
        compute_dtype: Any = None,
        source: str = "params",
    ) -> InferenceModel:
        """From a model / params. ``formats=None`` keeps the weights as given (float kernels
        dense, QArrays packed); otherwise each layer is quantized in memory like
        ``export_checkpoint(layer_formats=formats)``. ``activations``: W4A4 emulation
        (static scales from ``input_amax`` where given, else per-call)."""
        params = flat_params(params)
        check_params(params, config)
        if formats is None:
            layers = {
                p: (
                    LayerQuant(weights=params[f"{p}.kernel"].spec.name)
                    if isinstance(params[f"{p}.kernel"], QArray)
                    else LayerQuant()
                )
                for p in linear_paths(config)
            }
            scales: dict[str, Any] = {}
        else:
            layers = resolve_layers(config, formats, activations=activations)
            q = quantize_linear_weights(params, config, layers)
            params = {**params, **{f"{p}.kernel": w for p, w in q.items()}}
            scales = input_decode_scales(config, layers, input_amax) if input_amax else {}
        w = build_weights(
            params,
            config,
            layers,
            compute_dtype=compute_dtype or config.compute_dtype,
            input_scales=scales,
            activations=activations,
        )
        return cls(
            w,
            config,
            layers=layers,
            tokenizer=tokenizer,
            compute_dtype=compute_dtype,
            source=source,
        )

    @classmethod
    def from_checkpoint(
        cls,
        ck: Checkpoint | str | os.PathLike,
        *,
        activations: bool | None = None,
        compute_dtype: Any = None,
    ) -> InferenceModel:
        """From an exported folder (or a :class:`Checkpoint`); packed layers stay packed.
        ``activations=None`` emulates W4A4 iff the checkpoint declares quantized inputs."""
        if not isinstance(ck, Checkpoint):
            ck = read_checkpoint(ck)
        if activations is None:
            activations = any(lq.inputs is not None for lq in ck.layers.values())
        w = build_weights(
            ck.params,
            ck.config,
            ck.layers,
            compute_dtype=compute_dtype or ck.config.compute_dtype,
            input_scales=ck.input_scales,
            activations=activations,
        )
        return cls(
            w,
            ck.config,
            layers=ck.layers,
            tokenizer=ck.tokenizer(),
            compute_dtype=compute_dtype,
            source=str(ck.path),
        )

    # ------------------------------------------------------------------ forward
    @functools.cached_property
    def _logits_fn(self):
        cfg, cdt = self.config, self.compute_dtype

        @jax.jit
        def fn(weights, tokens):
            return forward(weights, tokens, cfg=cfg, cdt=cdt)[0]

        return fn

    def logits(self, tokens) -> jax.Array:
        """float32 logits ``[B, T, V]`` of int tokens ``[B, T]`` (full forward, no cache)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        if tokens.ndim != 2:
            raise ValueError(f"tokens of shape {tokens.shape}: expected [batch, seq]")
        return self._logits_fn(self.weights, tokens)

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        config: GenerationConfig | None = None,
        *,
        key: jax.Array | None = None,
    ) -> GenerationResult:
        """Continue each prompt (token ids). ``key``: PRNG key for sampling (required when
        ``config.temperature > 0``)."""
        gen = config or GenerationConfig()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError(
                "generate needs at least one prompt and every prompt must have at least one token"
            )
        lens = [len(p) for p in prompts]
        vocab = self.config.vocab_size
        for p in prompts:
            bad = [t for t in p if not 0 <= int(t) < vocab]
            if bad:
                raise ValueError(f"prompt token {bad[0]} is outside the vocabulary [0, {vocab})")
        if max(lens) + gen.max_new_tokens > self.config.max_seq_len:
            raise ValueError(
                f"prompt of {max(lens)} tokens + max_new_tokens="
                f"{gen.max_new_tokens} exceeds the model's max_seq_len="
                f"{self.config.max_seq_len}"
            )
        if not gen.greedy and key is None:
            raise ValueError(
                "sampling (temperature > 0) needs an explicit key, e.g. key=jax.random.key(0)"
            )
        plen = -(-max(lens) // _PROMPT_BUCKET) * _PROMPT_BUCKET
        batch = np.zeros((len(prompts), plen), np.int32)
        start = np.zeros((len(prompts),), np.int32)
        for i, p in enumerate(prompts):
            batch[i, plen - len(p) :] = np.asarray(p, np.int32)
            start[i] = plen - len(p)
        key = jax.random.key(0) if key is None else key
        stops = jnp.asarray(gen.stop_tokens or (-2,), jnp.int32)
        # Static: shapes and which filters run; traced: temperature, top_p, stop ids, key.
        toks, lengths, stopped = _generate(
            self.weights,
            jnp.asarray(batch),
            jnp.asarray(start),
            key,
            stops,
            jnp.float32(max(gen.temperature, 1e-6)),
            jnp.float32(gen.top_p),
            cfg=self.config,
            cdt=self.compute_dtype,
            n_new=gen.max_new_tokens,
            greedy=gen.greedy,
            top_k=gen.top_k,
            use_top_p=gen.top_p < 1.0,
        )
        return GenerationResult(
            tokens=np.asarray(toks), lengths=np.asarray(lengths), stopped=np.asarray(stopped)
        )

    def generate_text(
        self,
        prompts: Sequence[str],
        config: GenerationConfig | None = None,
        *,
        key: jax.Array | None = None,
    ) -> list[str]:
        """Encode, generate and decode with the model's tokenizer."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids to generate()")
        res = self.generate([self.tokenizer.encode(p) for p in prompts], config, key=key)
        return [self.tokenizer.decode(r) for r in res.rows()]

    # ------------------------------------------------------------------ evaluation
    def evaluate_ppl(self, batches) -> dict[str, float]:
        """See :func:`evaluate_ppl`."""
        return evaluate_ppl(self, batches)

    def memory_stats(self) -> MemoryStats:
        """Resident weight bytes, summed over the arrays actually held (``.nbytes`` of every
        packed layer's codes, scales and tensor scale; of every dense array)."""
        q_bytes = q_bf16 = dense = 0
        bits = 0.0
        n_packed = n_dense = 0
        for lw in self.weights["layers"]:
            for v in lw.values():
                if not isinstance(v, Linear):
                    continue
                if v.packed:
                    q = v.weight
                    n = math.prod(q.shape)
                    q_bytes += q.nbytes
                    q_bf16 += 2 * n
                    bits += n * q.spec.bits_per_element
                    n_packed += 1
                else:
                    dense += _nbytes(v.weight)
                    n_dense += 1
        other = _nbytes({k: v for k, v in self.weights.items() if k != "layers"}) + sum(
            _nbytes(v)
            for lw in self.weights["layers"]
            for v in lw.values()
            if not isinstance(v, Linear)
        )
        return MemoryStats(
            quantized_bytes=q_bytes,
            quantized_bf16_bytes=q_bf16,
            expected_ratio=bits / (16 * q_bf16 / 2) if q_bf16 else float("nan"),
            dense_linear_bytes=dense,
            other_bytes=other,
            packed_layers=n_packed,
            dense_layers=n_dense,
        )


@functools.partial(jax.jit, static_argnames=("cfg", "cdt", "n_new", "greedy", "top_k", "use_top_p"))
def _generate(
    weights,
    prompt,
    start,
    key,
    stops,
    temperature,
    top_p,
    *,
    cfg: ModelConfig,
    cdt,
    n_new: int,
    greedy: bool,
    top_k: int,
    use_top_p: bool,
):
    b, plen = prompt.shape
    cache = init_cache(cfg, b, plen + n_new, cdt)

    def sample(logits, k):
        if greedy:
            return sample_logits(logits, None)
        return sample_logits(
            logits, k, temperature=temperature, top_k=top_k, top_p=top_p if use_top_p else 1.0
        )

    logits, cache = forward(weights, prompt, cfg=cfg, cdt=cdt, cache=cache, index=0, start=start)
    tok = sample(logits[:, -1], jax.random.fold_in(key, 0))
    out = jnp.full((b, n_new), -1, jnp.int32).at[:, 0].set(tok)
    done = jnp.isin(tok, stops)
    lengths = jnp.ones((b,), jnp.int32)

    def cond(c):
        i, _, _, _, done, _ = c
        return (i < n_new) & ~jnp.all(done)

    def body(c):
        i, tok, cache, out, done, lengths = c
        feed = jnp.where(done, 0, tok)[:, None]
        logits, cache = forward(
            weights, feed, cfg=cfg, cdt=cdt, cache=cache, index=plen + i - 1, start=start
        )
        new = sample(logits[:, -1], jax.random.fold_in(key, i))
        new = jnp.where(done, -1, new)
        out = out.at[:, i].set(new)
        lengths = jnp.where(done, lengths, i + 1)
        done = done | jnp.isin(new, stops)
        return i + 1, new, cache, out, done, lengths

    _, _, _, out, done, lengths = jax.lax.while_loop(
        cond, body, (jnp.int32(1), tok, cache, out, done, lengths)
    )
    return out, lengths, done


# ---------------------------------------------------------------------- evaluation


def _as_batches(batches) -> np.ndarray:
    arr = np.asarray(batches)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3 or arr.shape[-1] < 2 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"batches of shape {arr.shape} ({arr.dtype}): expected int tokens "
            "[n, batch, seq + 1] or [batch, seq + 1]"
        )
    return arr


def evaluate_ppl(model: InferenceModel, batches) -> dict[str, float]:
    """Perplexity of next-token prediction on ``batches`` (int ``[n, B, T + 1]``, e.g.
    ``microscale.data.val_batches``): inputs ``[:, :-1]``, targets ``[:, 1:]``.
    Returns ``{"ppl": exp(nll), "nll": mean nats/token, "tokens": count}``."""
    arr = _as_batches(batches)
    if arr.min() < 0 or arr.max() >= model.config.vocab_size:
        raise ValueError(
            f"token ids {arr.min()}..{arr.max()} fall outside the model's "
            f"vocabulary [0, {model.config.vocab_size})"
        )
    if arr.shape[-1] - 1 > model.config.max_seq_len:
        raise ValueError(
            f"sequences of {arr.shape[-1] - 1} tokens exceed max_seq_len={model.config.max_seq_len}"
        )
    fn = _nll_fn(model.config, model.compute_dtype)
    total = 0.0
    for batch in arr:
        total += float(fn(model.weights, jnp.asarray(batch, jnp.int32)))
    count = int(arr.shape[0] * arr.shape[1] * (arr.shape[2] - 1))
    nll = total / count
    return {"ppl": float(math.exp(nll)), "nll": nll, "tokens": count}


@functools.lru_cache(maxsize=8)
def _nll_fn(cfg: ModelConfig, cdt):
    @jax.jit
    def fn(weights, batch):
        logits = forward(weights, batch[:, :-1], cfg=cfg, cdt=cdt)[0]
        return jnp.sum(token_nll(logits, batch[:, 1:]))

    return fn


# ---------------------------------------------------------------------- loading


def is_run_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a training run folder (:class:`~microscale.outputs.TrainingRun`)."""
    return TrainingRun.detect(Path(path))


def load_model(
    path: str | os.PathLike,
    *,
    formats: LayerFormats = None,
    activations: bool | None = None,
    compute_dtype: Any = None,
    step: int | None = None,
) -> InferenceModel:
    """An :class:`InferenceModel` from an exported HF-style folder or a training run folder.

    ``formats`` quantizes float weights in memory (a run's, or a plain HF folder's; a
    quantized export's layers are already fixed, so it is refused there). ``activations``:
    W4A4 emulation (default: as the checkpoint declares). ``step``: the run's checkpoint
    step (default: latest).
    """
    from microscale.files import check_input_dir

    p = check_input_dir(
        path,
        what="",
        expected="an exported model folder (config.json) or a "
        "microscale training run (config.yaml + checkpoints/)",
    )
    kind = detect(p)
    if TrainingRun.detect(p):
        from microscale.data import load_tokenizer
        from microscale.train import load_checkpoint

        model, tcfg, _ = load_checkpoint(p, step)
        tok_file = p / TrainingRun.TOKENIZER
        tok = load_tokenizer(tok_file) if tok_file.is_file() else None
        return InferenceModel.from_params(
            model,
            tcfg.model,
            formats=formats,
            activations=bool(activations),
            tokenizer=tok,
            compute_dtype=compute_dtype,
            source=str(p),
        )
    if isinstance(kind, Layout) and kind.hf_folder:
        if formats is None:
            return InferenceModel.from_checkpoint(
                p, activations=activations, compute_dtype=compute_dtype
            )
        if kind.quantized:
            raise ValueError(
                f"{str(p)!r} is a {kind.name} export whose layers are already "
                "stored in their formats; formats= applies to float weights (a "
                "training run or a plain HF folder)"
            )
        ck = read_checkpoint(p)
        return InferenceModel.from_params(
            ck.params,
            ck.config,
            formats=formats,
            activations=bool(activations),
            tokenizer=ck.tokenizer(),
            compute_dtype=compute_dtype,
            source=str(p),
        )
    raise FileNotFoundError(
        f"{str(p)!r} is neither an exported model folder (config.json) "
        "nor a microscale training run (config.yaml + checkpoints/)"
    )
