"""The model under quantization: a functional view of any NNX model with linear layers.

:class:`Engine` splits a model into ``(graphdef, params, rest)`` once, on a private copy
whose linear layers run the ``bf16`` recipe (the reference: full-precision master weights,
bfloat16 GEMM operands) with block remat off and attention in query chunks (memory linear
in the window length), and compiles the few traced functions PTQ needs:

* ``loss(params, tokens)`` -- mean next-token cross-entropy (or a user ``loss_fn``);
  evaluating a quantized model = the same function with fake-quantized kernels in
  ``params`` (weight-only) and, for W4A4, each layer's input quantized by a hook;
* ``input_amax(params, tokens)`` -- ``max|X_l|`` of every layer's input (calibration);
* ``grad_terms(batches, deltas)`` -- for every layer ``l`` and candidate format ``f`` the
  Taylor terms of the loss change (first order ``sum(dL/dY_l * dY_lf)``, the Fisher
  forms) from ONE forward and backward pass per batch, with ``dY_lf = X_l (W_lf - W_l)``
  (or ``Q_f(X_l) W_lf - X_l W_l`` for W4A4);
* ``kl(params, tokens, ref_logp)`` -- ``KL(p_ref || p)`` of the next-token distributions.

Kernels are ``[in, out]`` (``Y = X W``); the model casts them to bfloat16, so a weight
"in format f" is ``bf16(dequantize(quantize(W)))`` and ``dW = bf16(W_q) - bf16(W)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from microscale.export.registry import table_values
from microscale.formats import QArray, dequantize, get_format, quantize_dequantize, tensor_amax
from microscale.model import PrecisionRules, apply_rules
from microscale.ops.loss import cross_entropy
from microscale.ptq.tap import intercept_linears, tappable_paths, without_remat

__all__ = ["ActQuant", "Engine", "next_token_loss"]

LossFn = Callable[[Any, jax.Array], jax.Array]

# The Taylor terms of Engine.grad_terms, in the order the compiled function stacks them.
_GRAD_TERMS = ("fisher", "linear", "token_fisher", "taylor")


def next_token_loss(model: Any, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of ``model(tokens[:, :-1])`` against ``tokens[:, 1:]``."""
    return cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])


def _next_token_logp(model: Any, tokens: jax.Array) -> jax.Array:
    return jax.nn.log_softmax(model(tokens[:, :-1]).astype(jnp.float32), axis=-1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActQuant:
    """Input (activation) quantization of the linear layers, for W4A4-style evaluation.

    Compiled once per ``palette`` (the formats that may occur): which layer uses which
    palette entry, the amax values and whether they are static are traced inputs, so
    evaluating many allocations, static or dynamic, does not recompile (``lax.switch``
    runs only the selected quantizer).
    """

    # {layer path: format name} of the layers whose input is quantized (along features).
    formats: tuple[tuple[str, str], ...]
    # Static calibrated tensor amax per layer ({path: amax}); None = dynamic (the batch's
    # own amax, "current scaling"). Only formats with a tensor scale use it.
    amax: Mapping[str, float] | None = None
    # Formats the compiled function can apply (static); None = those in ``formats``.
    palette: tuple[str, ...] | None = None

    def __post_init__(self):
        fm = tuple(
            sorted(
                (str(p), str(f)) for p, f in dict(self.formats).items() if get_format(f).quantized
            )
        )
        object.__setattr__(self, "formats", fm)
        pal = (
            tuple(sorted({f for _, f in fm}))
            if self.palette is None
            else tuple(f for f in self.palette if get_format(f).quantized)
        )
        missing = sorted({f for _, f in fm} - set(pal))
        if missing:
            raise ValueError(f"ActQuant: format(s) {missing} are not in palette {pal}")
        object.__setattr__(self, "palette", pal)
        if self.amax is not None:
            lack = [p for p, _ in fm if p not in self.amax]
            if lack:
                raise ValueError(f"ActQuant: no static amax for layer(s) {lack}")

    @classmethod
    def matching(
        cls,
        assignment: Mapping[str, str],
        amax: Mapping[str, float] | None = None,
        palette: tuple[str, ...] | None = None,
    ) -> ActQuant:
        """Inputs in the same format as each layer's weight (bf16 layers: untouched)."""
        return cls(
            formats=tuple(assignment.items()),
            amax=None if amax is None else dict(amax),
            palette=palette,
        )

    def static_key(self) -> tuple:
        return (self.palette,)


def _qact(x: jax.Array, fmt: str, amax) -> jax.Array:
    vals, scale = quantize_dequantize(
        x, fmt, axis=-1, amax=amax, dtype=jnp.float32, with_global_scale=True
    )
    del scale
    return vals.astype(x.dtype)


class Engine:
    """A model prepared for calibration, scoring and evaluation (see the module doc)."""

    _input_owner: dict[str, str]  # set when the Hessian pass is traced (input_hessians)

    def __init__(
        self, model: Any, *, loss_fn: LossFn | None = None, attention_chunk: int | None = 128
    ):
        """``model``: an NNX model (untouched: a private copy of its graph is used);
        ``loss_fn(model, tokens)``: default :func:`next_token_loss`; ``attention_chunk``:
        the copy's attention chunk (query positions whose float32 attention scores exist
        at once, ``Transformer.set_attention_chunk``; None: the model's own). Every pass holds ``[rows, heads, chunk, seq]`` scores
        instead of ``[rows, heads, seq, seq]`` per layer; on SmolLM2-135M's 2 x 512-token
        batches the score pass's XLA temporaries drop from 3.4 to 1.7 GB and it runs
        faster (docs/ptq/real-model.md)."""
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
        work = nnx.merge(graphdef, params, rest)  # a private copy of the graph
        apply_rules(work, PrecisionRules(default="bf16"))
        without_remat(work)
        if attention_chunk is not None and hasattr(work, "set_attention_chunk"):
            work.set_attention_chunk(attention_chunk)
        self.paths: list[str] = tappable_paths(work)
        if not self.paths:
            raise ValueError(
                "Engine: the model has no linear layer with a 2-D kernel "
                "(QLinear / nnx.Linear) to quantize"
            )
        self.graphdef, params, self.rest = nnx.split(work, nnx.Param, ...)  # type: ignore[misc]
        self.params: dict = nnx.to_pure_dict(params)
        self._kernel_keys = self._find_kernels(params)
        self.loss_fn: LossFn = loss_fn or next_token_loss
        self._jit_cache: dict[Any, Callable] = {}
        self.kernels: dict[str, jax.Array] = {
            p: self._get(self.params, k) for p, k in self._kernel_keys.items()
        }
        self.numel = {p: int(np.prod(k.shape)) for p, k in self.kernels.items()}
        # each layer's row width (its inputs, K of the [K, N] kernel): what a ggml type's
        # blocks must divide (formats.ggml.layer_format)
        self.rows = {p: int(k.shape[0]) for p, k in self.kernels.items()}
        # Parameters that are not candidate kernels (embeddings, norms, LM head).
        total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.params))
        self.other_numel = total - sum(self.numel.values())
        # The tables a GGUF stores in its embed format: the token embedding [vocab,
        # d_model] and an untied LM head [d_model, vocab] (microscale's Transformer
        # names) as {param key: True when transposed}; {} for a model without them.
        self.tables: dict[tuple[str, ...], bool] = {
            key: transposed
            for key, transposed in ((("embed", "embedding"), False), (("lm_head", "kernel"), True))
            if key[0] not in self.paths and _is_matrix(self.params, key)
        }
        self.table_numel = sum(int(np.prod(self._get(self.params, k).shape)) for k in self.tables)

    # ------------------------------------------------------------------ params helpers
    def _find_kernels(self, params) -> dict[str, tuple]:
        keys = {}
        want = set(self.paths)
        for parts, _ in nnx.to_flat_state(params):
            if parts and parts[-1] == "kernel":
                path = ".".join(str(p) for p in parts[:-1])
                if path in want:
                    keys[path] = tuple(parts)
        missing = sorted(want - set(keys))
        if missing:
            raise ValueError(f"Engine: no 'kernel' parameter found for linear layer(s) {missing}")
        return {p: keys[p] for p in self.paths}

    @staticmethod
    def _get(tree, key):
        for k in key:
            tree = tree[k]
        return tree

    def with_kernels(self, kernels: Mapping[str, jax.Array], params: dict | None = None) -> dict:
        """A params tree (default: the model's) with some kernels replaced (copy on write;
        shapes must match)."""
        out = dict(self.params if params is None else params)
        for path, value in kernels.items():
            ref = self.kernels[path]
            if tuple(value.shape) != tuple(ref.shape):
                raise ValueError(
                    f"kernel for {path!r} has shape {tuple(value.shape)}; "
                    f"expected {tuple(ref.shape)}"
                )
            _set(out, self._kernel_keys[path], jnp.asarray(value, ref.dtype))
        return out

    def with_tables(self, fmt: str, params: dict | None = None) -> dict:
        """A params tree (default: the model's) whose token embedding and untied LM head
        (:attr:`tables`) hold the values llama.cpp decodes from them stored in ``fmt``
        (:func:`microscale.export.registry.table_values`); ``fmt`` unquantized: unchanged."""
        out = dict(self.params if params is None else params)
        if not get_format(fmt).quantized:
            return out
        for key, transposed in self.tables.items():
            ref = self._get(self.params, key)
            table = ref.T if transposed else ref
            values = table_values(table, fmt)
            _set(out, key, jnp.asarray(values.T if transposed else values, ref.dtype))
        return out

    def _model(self, params):
        return nnx.merge(self.graphdef, nnx.State(params), self.rest)

    def model(self) -> Any:
        """The engine's private copy as an NNX model (bf16 recipe, block remat off), with
        its parameters (e.g. AWQ's folded ones): what its passes run."""
        return self._model(self.params)

    def _cached(self, key, build: Callable[[], Callable]) -> Callable:
        if key not in self._jit_cache:
            self._jit_cache[key] = build()
        return self._jit_cache[key]

    # ------------------------------------------------------------------ traced functions
    def _act_hook(self, palette: tuple[str, ...], sel, amax):
        """Quantize each tapped layer's input with ``palette[sel[path] - 1]`` (0: none)."""

        def hook(path, call, x):
            if palette:
                # dynamic: the batch's own amax, as quantize_dequantize(amax=None) takes it
                values, static = amax
                a = jnp.where(static, values[path], tensor_amax(x))
                branches = [lambda v, _a: v] + [
                    (lambda v, a_, f=f: _qact(v, f, a_)) for f in palette
                ]
                x = jax.lax.switch(sel[path], branches, x, a)
            return call(x)

        return hook

    def _act_inputs(self, act: ActQuant | None):
        """(static palette, traced selectors {path: int32}, traced amax: ({path: f32},
        static bool); the values are unused when dynamic)."""
        if act is None:
            return (), None, None
        chosen = dict(act.formats)
        assert act.palette is not None  # ActQuant always carries its palette
        sel = {
            p: jnp.int32(act.palette.index(chosen[p]) + 1 if p in chosen else 0) for p in self.paths
        }
        given = act.amax or {}
        amax = {p: jnp.float32(given.get(p, 1.0)) for p in self.paths}
        return act.palette, sel, (amax, jnp.bool_(act.amax is not None))

    def _loss_jit(self, act: ActQuant | None) -> Callable:
        static = None if act is None else act.static_key()
        palette = () if act is None else act.palette

        def build():
            def f(params, tokens, sel, amax):
                model = self._model(params)
                with intercept_linears(model, self._act_hook(palette, sel, amax)):
                    return self.loss_fn(model, tokens)

            return jax.jit(f)

        return self._cached(("loss", static), build)

    def batch_losses(
        self,
        params: dict,
        batches,
        act: ActQuant | None = None,
        *,
        progress: Callable[[], None] | None = None,
    ) -> np.ndarray:
        """The loss of each batch (float64 ``[n]``; for paired comparisons); ``progress``
        is called after each batch."""
        fn = self._loss_jit(act)
        _, sel, amax = self._act_inputs(act)
        vals = []
        for b in batches:
            vals.append(float(fn(params, jnp.asarray(b), sel, amax)))
            if progress is not None:
                progress()
        if not vals:
            raise ValueError("Engine.loss: no batches")
        return np.asarray(vals, np.float64)

    def loss(self, params: dict, batches, act: ActQuant | None = None) -> float:
        """Mean loss over ``batches`` (int32 ``[n, rows, seq + 1]`` or a list of batches)."""
        return float(np.mean(self.batch_losses(params, batches, act)))

    def input_amax(
        self, batches, *, progress: Callable[[], None] | None = None
    ) -> dict[str, float]:
        """``max |X_l|`` over ``batches`` of every linear layer's input (float32);
        ``progress`` is called after each batch."""

        def build():
            def f(params, tokens):
                model = self._model(params)
                seen = {}

                def hook(path, call, x):
                    seen[path] = tensor_amax(x)
                    return call(x)

                with intercept_linears(model, hook):
                    self.loss_fn(model, tokens)
                return seen

            return jax.jit(f)

        fn = self._cached(("amax",), build)
        out = {p: 0.0 for p in self.paths}
        for b in batches:
            got = fn(self.params, jnp.asarray(b))
            out = {p: max(out[p], float(got[p])) for p in self.paths}
            if progress is not None:
                progress()
        return out

    def input_hessians(
        self,
        batches,
        *,
        act_format: str | None = None,
        act_amax: Mapping[str, float] | None = None,
        progress: Callable[[], None] | None = None,
    ) -> dict[str, np.ndarray]:
        """``H_l = 2 X_l^T X_l / n`` (float64 ``[in, in]``) of every linear layer's input
        over ``batches`` (``n``: tokens), GPTQ's Hessian of the layer's output error. Layers
        that read the same input (q/k/v, gate/up) share one array. ``progress`` is called
        after each batch.

        ``act_format``: the inputs as a W4A4 / W8A8 layer reads them, quantized in that
        format (``X_l`` -> ``Q_f(X_l)``, with the static ``act_amax[l]`` when given, else
        each batch's own amax, as :class:`ActQuant` evaluates them), so GPTQ minimises the
        output error of the GEMM that runs: ``||Q_f(X) W - Q_f(X) W_q||``."""
        if act_format is not None and not get_format(act_format).quantized:
            act_format = None  # an unquantized input format reads X itself
        amax = (
            None
            if act_amax is None or act_format is None
            else {p: jnp.float32(act_amax[p]) for p in self.paths}
        )

        def build():
            def f(params, tokens, amax):
                model = self._model(params)
                seen: dict[str, jax.Array] = {}

                def hook(path, call, x):
                    self._note_input(seen, path, x)
                    return call(x)

                with intercept_linears(model, hook):
                    self.loss_fn(model, tokens)
                grams = {}
                for p, x in seen.items():
                    if act_format is not None:
                        x = _qact(x, act_format, None if amax is None else amax[p])
                    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
                    grams[p] = x2.T @ x2
                return grams

            return jax.jit(f)

        fn = self._cached(("hessian", act_format, amax is None), build)
        sums: dict[str, np.ndarray] = {}
        n_tok = 0
        for b in batches:
            b = jnp.asarray(b)
            grams = fn(self.params, b, amax)
            for p, g in grams.items():
                g = np.asarray(g, np.float64)
                sums[p] = sums[p] + g if p in sums else g
            n_tok += int(np.prod(b.shape[:-1])) * (b.shape[-1] - 1)
            if progress is not None:
                progress()
        if not n_tok:
            raise ValueError("Engine.input_hessians: no batches")
        hs = {p: 2.0 * h / n_tok for p, h in sums.items()}
        return {p: hs[self._input_owner[p]] for p in self.paths}

    def _note_input(self, seen: dict[str, jax.Array], path: str, x: jax.Array) -> None:
        """While tracing: keep ``x`` as layer ``path``'s input in ``seen`` unless an earlier
        layer read the same array (q/k/v, gate/up); ``self._input_owner[path]`` names the
        layer whose entry holds it."""
        owner: dict[str, str] = self.__dict__.setdefault("_input_owner", {})
        same = [p for p, v in seen.items() if v is x]
        owner[path] = same[0] if same else path
        if not same:
            seen[path] = x

    def _score_jit(self, fmts: tuple[str, ...], use_act: tuple[bool, ...]) -> Callable:
        """``(params, tokens, cands, amax, True) -> ({path: [len(fmts), len(_GRAD_TERMS)]},
        {path: max |X|})``: the Taylor terms of every layer in every format from ONE forward
        and backward pass, and each layer's input amax on the batch (what
        :meth:`input_amax` computes, for free here).

        Each layer's output passes through :func:`_probe` (an identity whose backward
        also returns the layer's terms as the cotangent of a zero "probe"), so the terms
        of layer ``l`` are computed inside the backward pass from ``g = dL/dY_l`` and the
        input ``X_l`` kept for it: no layer's ``X`` or ``g`` leaves the compiled function
        (one call per batch instead of one per layer and format, and no host copies)."""

        def build():
            zero = jnp.zeros((len(fmts), len(_GRAD_TERMS)), jnp.float32)

            def f(params, tokens, cands, amax, live):
                def loss(probes):
                    model = self._model(params)
                    seen = {}

                    def hook(path, call, x):
                        seen[path] = tensor_amax(x)
                        kernel = self._get(params, self._kernel_keys[path])
                        a = None if amax is None else amax[path]

                        def layer(ops):
                            x, g = ops
                            y = _dot(x, kernel)  # the reference output, shared by the formats
                            return jnp.stack(
                                [
                                    _layer_terms(x, g, cands[fm][path], y, a, fm if on else None)
                                    for fm, on in zip(fmts, use_act, strict=True)
                                ]
                            )

                        def terms(x, g):
                            # a branch on a traced True: each layer's scoring is its own
                            # computation, so XLA cannot hoist its g-independent part out
                            # of it (decoding the candidates: every layer's would be live at
                            # once, 2 GB more for SmolLM2-135M)
                            return jax.lax.cond(live, layer, lambda _: zero, (x, g))

                        return _probe(terms)(call(x), x, probes[path])

                    with intercept_linears(model, hook):
                        return self.loss_fn(model, tokens), seen

                return jax.grad(loss, has_aux=True)({p: zero for p in self.paths})

            return jax.jit(f)

        return self._cached(("score", fmts, use_act), build)

    def grad_terms(
        self,
        batches,
        deltas: Mapping[str, Mapping[str, Any]],
        act_formats: Mapping[str, bool] | None = None,
        act_amax: Mapping[str, float] | None = None,
        quantized_kernels: Mapping[str, Mapping[str, jax.Array]] | None = None,
        *,
        input_amax: dict[str, float] | None = None,
        progress: Callable[[], None] | None = None,
    ) -> dict[str, dict[str, dict[str, float]]]:
        """Taylor terms ``{term: {path: {format: sum over batches}}}`` with ``g = dL/dY``
        of the batch's mean loss and ``dY`` the output change of the layer in the format:

        * ``"fisher"``: ``sum((g * dY)^2)`` (diagonal Fisher, ModelOpt's score);
        * ``"linear"``: ``sum(g * dY)`` (the first-order loss change, signed);
        * ``"token_fisher"``: ``sum_tokens (sum_features g * dY)^2`` (the empirical Fisher
          quadratic form of each token's output change, cross-feature terms included);
        * ``"taylor"``: ``linear + (N / 2) token_fisher``, the second-order estimate of the
          loss change (``N`` = tokens the batch's mean loss averages over: ``g`` is
          ``1/N`` times each token's own gradient, so the empirical Fisher of the mean
          loss is ``N`` times the sum of the ``g g^T``).

        ``deltas[fmt][path]``: ``bf16(W_q) - bf16(W)`` ``[in, out]``, or the candidate
        itself as a :class:`~microscale.formats.QArray` of ``W^T`` (the export layout;
        ``dW`` is then formed from it inside the compiled function, one layer at a time).
        One compiled forward and backward pass per batch scores every layer in every
        format: ``dY = X dW`` is one extra GEMM per layer and format inside the backward
        pass (:meth:`_score_jit`), with ``dW`` decoded there from the packed candidates, so
        no dequantized copy of every layer in every format is held. With
        ``act_formats[fmt]`` true the input is quantized
        too (W4A4-style): ``dY = Q_f(X) W_q - X W`` with ``W_q = quantized_kernels[fmt]
        [path]`` (or the QArray's values) and the static ``act_amax`` when given.
        ``input_amax``: a dict filled with every layer's input amax over ``batches`` (the
        same pass: :meth:`input_amax` without its forward passes). ``progress`` is called
        after each batch.
        """
        fmts = tuple(deltas)
        act_formats = dict(act_formats or {})
        use_act = tuple(bool(act_formats.get(f, False)) and get_format(f).quantized for f in fmts)
        amax = None if act_amax is None else {p: jnp.float32(act_amax[p]) for p in self.paths}
        cands: dict[str, dict[str, Any]] = {}
        for f, act_on in zip(fmts, use_act, strict=True):
            cands[f] = {}
            for p in self.paths:
                cand = deltas[f][p]
                if act_on and not isinstance(cand, QArray):
                    assert quantized_kernels is not None  # given with act_formats
                    cand = quantized_kernels[f][p]
                cands[f][p] = cand if isinstance(cand, QArray) else jnp.asarray(cand, jnp.float32)
        fn = self._score_jit(fmts, use_act)
        terms = {k: {p: {f: 0.0 for f in fmts} for p in self.paths} for k in _GRAD_TERMS}
        seen = {p: 0.0 for p in self.paths}
        for b in batches:
            got, got_amax = jax.device_get(
                fn(self.params, jnp.asarray(b), cands, amax, jnp.bool_(True))
            )
            seen = {p: max(seen[p], float(got_amax[p])) for p in self.paths}
            for p in self.paths:
                for j, f in enumerate(fmts):
                    for i, k in enumerate(_GRAD_TERMS):
                        terms[k][p][f] += float(got[p][j, i])
            if progress is not None:
                progress()
        if input_amax is not None:
            input_amax.update(seen)
        return terms

    def ref_logp(self, tokens) -> jax.Array:
        """Log-probabilities ``[rows, seq, vocab]`` of the reference model on one batch."""

        def build():
            return jax.jit(lambda params, t: _next_token_logp(self._model(params), t))

        return self._cached(("logp",), build)(self.params, jnp.asarray(tokens))

    def kl_and_loss(
        self, params: dict, tokens, ref_logp, act: ActQuant | None = None
    ) -> tuple[float, float]:
        """``(KL(p_ref || p_params), loss)`` on one batch (means over tokens)."""
        static = None if act is None else act.static_key()
        palette = () if act is None else act.palette

        def build():
            def f(params, tokens, ref, sel, amax):
                model = self._model(params)
                with intercept_linears(model, self._act_hook(palette, sel, amax)):
                    logits = model(tokens[:, :-1]).astype(jnp.float32)
                logp = jax.nn.log_softmax(logits, axis=-1)
                kl = jnp.sum(jnp.exp(ref) * (ref - logp), axis=-1).mean()
                return kl, cross_entropy(logits, tokens[:, 1:])

            return jax.jit(f)

        fn = self._cached(("kl", static), build)
        _, sel, amax = self._act_inputs(act)
        kl, nll = fn(params, jnp.asarray(tokens), ref_logp, sel, amax)
        return float(kl), float(nll)


def _is_matrix(params: dict, key: tuple[str, ...]) -> bool:
    node: Any = params
    for k in key:
        if not isinstance(node, dict) or k not in node:
            return False
        node = node[k]
    return len(getattr(node, "shape", ())) == 2


def _set(tree: dict, key: tuple, value: Any) -> None:
    """``tree[key[0]]...[key[-1]] = value``, copying each dict on the way (copy on write)."""
    node = tree
    for k in key[:-1]:
        node[k] = dict(node[k])
        node = node[k]
    node[key[-1]] = value


def _probe(terms: Callable[[jax.Array, jax.Array], jax.Array]) -> Callable:
    """``tap(y, x, probe) -> y``, an identity on a layer's output ``y`` whose backward
    passes the output cotangent ``g`` through unchanged and returns ``terms(x, g)`` (the
    layer's input ``x``) as the cotangent of ``probe`` (zeros of that shape): the
    gradient of the loss with respect to the probes is every layer's terms."""

    @jax.custom_vjp
    def tap(y, x, probe):
        return y

    def fwd(y, x, probe):
        return y, x

    def bwd(x, g):
        return g, jnp.zeros_like(x), terms(x, g)

    tap.defvjp(fwd, bwd)
    return tap


def _dot(x, w) -> jax.Array:
    """``bf16(x) @ bf16(w)`` with float32 products and accumulation (the layer's GEMM:
    bf16 x bf16 products are exact in float32), on the CPU's fast bf16 path."""
    bf = jnp.bfloat16
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    return jax.lax.dot_general(x.astype(bf), w.astype(bf), dims, preferred_element_type=jnp.float32)


def _layer_terms(x, g, cand, y, amax, act_fmt: str | None) -> jax.Array:
    """One layer's Taylor terms (:data:`_GRAD_TERMS`, stacked) in one format from its input
    ``x``, output gradient ``g`` and reference output ``y = bf16(X) bf16(W)`` (float32):

    * weight-only, the candidate's QArray: ``dY = X W_q - y`` with ``W_q =
      bf16(dequantize(cand)^T)``, the values the model computes with;
    * weight-only, ``cand = dW`` (float32, not a bf16 value): ``dY = X dW_hi + X dW_lo``
      with ``dW_hi = bf16(dW)``, ``dW_lo = bf16(dW - dW_hi)`` (``dW`` to 2^-17);
    * ``act_fmt`` (the input quantized too; ``cand``: ``W_q`` or its QArray):
      ``dY = Q_f(X) W_q - y``.

    Every GEMM has bf16 operands and float32 accumulation (3x a float32 GEMM's speed on
    CPU); the difference of two such outputs carries their float32 rounding, ~1e-6 of
    ``dY``."""
    if act_fmt is not None or isinstance(cand, QArray):  # cand: the quantized kernel
        if isinstance(cand, QArray):
            cand = dequantize(cand).T
        dy = _dot(x if act_fmt is None else _qact(x, act_fmt, amax), cand) - y
    else:  # cand: dW
        hi = cand.astype(jnp.bfloat16)
        dy = _dot(x, hi) + _dot(x, cand - hi.astype(cand.dtype))
    gp = g.astype(jnp.float32)
    lin = jnp.sum(gp * dy)  # first order
    tok = jnp.sum(jnp.square(jnp.sum(gp * dy, -1)))  # per-token Fisher
    n_tok = np.prod(gp.shape[:-1])  # loss terms
    return jnp.stack(
        [
            jnp.sum(jnp.square(gp * dy)),  # diagonal Fisher
            lin,
            tok,
            lin + 0.5 * n_tok * tok,  # Taylor estimate
        ]
    )
