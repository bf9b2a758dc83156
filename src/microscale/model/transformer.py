"""A Llama-style decoder-only transformer in Flax NNX whose linear layers train in any
microscale recipe.

Per block (pre-norm, residual stream in float32)::

    h   = x + o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))  n = attn_norm(x)
    out = h + down_proj(silu(gate_proj(m)) * up_proj(m))                     m = mlp_norm(h)

Attention is causal grouped-query attention: ``n_heads`` query heads share
``n_kv_heads`` key/value heads, query head ``h`` reading kv head ``h // (n_heads /
n_kv_heads)`` (the layout of HF's ``repeat_kv``). Scores ``QK^T / sqrt(head_dim)`` and
the value product run with ``compute_dtype`` operands and float32 accumulation; the
softmax is float32. RoPE follows the HF Llama "rotate half" layout, so the q/k kernels map
to HF checkpoints by a transpose alone.

The seven projections per block are `QLinear`\\ s; their recipes come from a
`PrecisionRules` (default: every layer bf16). Everything else — embedding, norms,
attention products, LM head — is high precision
(docs/design.md#what-stays-in-high-precision). ``__call__`` takes a PRNG ``key`` (fresh
per training step); each projection folds in a stable id of its path, so
stochastic rounding never repeats across layers or steps. ``key=None`` is fine for a
forward pass; a recipe with stochastic rounding needs a key to differentiate.

Parameter paths (also the rule paths; `microscale.export` maps them to HF names)::

    embed.embedding                         [vocab, d_model]      ('vocab', 'embed')
    layers.<i>.attn_norm.scale              [d_model]             ('norm',)
    layers.<i>.attn.q_proj.kernel           [d_model, H*hd]       ('embed', 'heads')
    layers.<i>.attn.k_proj.kernel           [d_model, KV*hd]      ('embed', 'kv_heads')
    layers.<i>.attn.v_proj.kernel           [d_model, KV*hd]      ('embed', 'kv_heads')
    layers.<i>.attn.o_proj.kernel           [H*hd, d_model]       ('heads', 'embed')
    layers.<i>.mlp_norm.scale               [d_model]             ('norm',)
    layers.<i>.mlp.gate_proj.kernel         [d_model, d_ff]       ('embed', 'mlp')
    layers.<i>.mlp.up_proj.kernel           [d_model, d_ff]       ('embed', 'mlp')
    layers.<i>.mlp.down_proj.kernel         [d_ff, d_model]       ('mlp', 'embed')
    final_norm.scale                        [d_model]             ('norm',)
    lm_head.kernel                          [d_model, vocab]      ('embed', 'vocab')  (untied only)

Causality caveat: a recipe with a per-tensor scale (NVFP4's global scale, FP8) takes the
amax over the whole activation tensor — every token of the batch — so a later token can
change the rounding of an earlier one (and one sequence another's). Causal masking is
exact; bit-exact causality of the logits holds for block-local recipes (bf16, MX).

Memory: ``config.remat`` names a policy of `REMAT_POLICIES` under which each block runs
in ``nnx.remat`` (jax.checkpoint): ``full`` keeps only block inputs for the backward pass
(the llama presets' default), ``save_dots`` the projections' outputs, ``minimal`` the
attention output and MLP hidden, ``none`` everything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from microscale.model.config import ModelConfig
from microscale.model.layers import Embed, LMHead, QLinear, RMSNorm, apply_rope, rope_tables
from microscale.model.rules import PrecisionRules, RecipeLike, apply_rules, path_id
from microscale.model.sharding import constrain
from microscale.model.tensor_parallel import column_parallel, row_parallel

# Logical axes of the activations (microscale.model.sharding maps them to the mesh).
RESIDUAL = ("act_batch", "act_residual_length", "act_embed")

__all__ = [
    "BLOCK_LINEARS",
    "FUSED_LINEARS",
    "MLP",
    "Attention",
    "Block",
    "Transformer",
    "causal_attention",
    "fused_groups",
    "linear_paths",
]

# The seven linear layers of a block, by their path inside it, in model order.
BLOCK_LINEARS: tuple[str, ...] = (
    "attn.q_proj",
    "attn.k_proj",
    "attn.v_proj",
    "attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# The one table of fused linears: {group path inside a block: its members}. Inference
# engines (vLLM, TensorRT-LLM, llama.cpp) run each group as one GEMM, so its members share
# a number format (PTQ's search, `microscale.ptq.search.DEFAULT_GROUPS`) and a tensor scale
# (export, `fused_groups`).
FUSED_LINEARS: dict[str, tuple[str, ...]] = {
    "attn.qkv_proj": ("attn.q_proj", "attn.k_proj", "attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def linear_paths(cfg: ModelConfig) -> list[str]:
    """Paths of every quantizable linear layer of a `Transformer` of ``cfg``, in model
    order (``layers.<i>.<kind>`` for each kind of `BLOCK_LINEARS`; not the LM head)."""
    return [f"layers.{i}.{k}" for i in range(cfg.n_layers) for k in BLOCK_LINEARS]


def fused_groups(cfg: ModelConfig) -> list[tuple[str, ...]]:
    """The linear paths of ``cfg`` grouped as inference engines fuse them: per block, the
    groups of `FUSED_LINEARS`, then the unfused linears as singletons. Every path of
    `linear_paths` is in exactly one group."""
    fused = {m for members in FUSED_LINEARS.values() for m in members}
    out: list[tuple[str, ...]] = []
    for i in range(cfg.n_layers):
        out += [tuple(f"layers.{i}.{m}" for m in g) for g in FUSED_LINEARS.values()]
        out += [(f"layers.{i}.{k}",) for k in BLOCK_LINEARS if k not in fused]
    return out


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, chunk: int = 0) -> jax.Array:
    """Causal GQA. q ``[B, T, H, hd]``, k/v ``[B, S, KV, hd]`` with H % KV == 0 and the
    last T of S positions being the queries (S == T in training). Returns ``[B, T, H, hd]``
    in q's dtype. Scores and softmax in float32.

    ``chunk > 0`` (and ``< T``): the queries in chunks of that many positions, one at a time
    (``lax.map``), each chunk's scores recomputed in the backward pass
    (``jax.checkpoint``): ``[B, H, chunk, S]`` float32 scores live instead of
    ``[B, H, T, S]``, memory linear in T. Every query row is the same computation either
    way (its softmax runs over all its keys); a last partial chunk is zero-padded and cut.
    """
    t, s = q.shape[1], k.shape[1]
    if not chunk or chunk >= t:
        return _attention(q, k, v, s - t)
    b, _, h, hd = q.shape
    n = -(-t // chunk)
    qs = jnp.pad(q, ((0, 0), (0, n * chunk - t), (0, 0), (0, 0)))
    qs = qs.reshape(b, n, chunk, h, hd).swapaxes(0, 1)
    starts = jnp.arange(n) * chunk + (s - t)
    heads = ("act_batch", "act_length", "act_heads", None)
    one = jax.checkpoint(
        lambda qc, start: constrain(_attention(constrain(qc, heads), k, v, start), heads)
    )
    out = jax.lax.map(lambda a: one(*a), (qs, starts))  # [n, B, chunk, H, hd]
    return out.swapaxes(0, 1).reshape(b, n * chunk, h, hd)[:, :t]


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, start) -> jax.Array:
    """Queries at positions ``start + arange(T)`` against keys at ``arange(S)``."""
    b, t, h, hd = q.shape
    s, kv = k.shape[1], k.shape[2]
    g = h // kv
    qg = q.reshape(b, t, kv, g, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (hd**-0.5)
    q_pos = jnp.arange(t)[:, None] + start
    mask = q_pos >= jnp.arange(s)[None, :]  # [T, S]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, hd).astype(q.dtype)


def _linear(
    cfg: ModelConfig,
    path: str,
    din: int,
    dout: int,
    axes,
    *,
    rngs: nnx.Rngs,
    std: float | None = None,
) -> QLinear:
    return QLinear(
        din,
        dout,
        rngs=rngs,
        recipe="bf16",
        layer_id=path_id(path),
        axes=axes,
        init_std=cfg.init_std if std is None else std,
        param_dtype=cfg.param_dtype,
        compute_dtype=cfg.compute_dtype,
    )


def _out_std(cfg: ModelConfig) -> float:
    return cfg.init_std / (2 * cfg.n_layers) ** 0.5 if cfg.scale_residual_init else cfg.init_std


class Attention(nnx.Module):
    """Grouped-query causal self-attention with RoPE; q/k/v/o are QLinears."""

    def __init__(self, cfg: ModelConfig, prefix: str, *, rngs: nnx.Rngs):
        d, hd = cfg.d_model, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, hd
        self.attention_chunk = cfg.attention_chunk
        self.q_proj = _linear(
            cfg, f"{prefix}.q_proj", d, cfg.n_heads * hd, ("embed", "heads"), rngs=rngs
        )
        self.k_proj = _linear(
            cfg, f"{prefix}.k_proj", d, cfg.n_kv_heads * hd, ("embed", "kv_heads"), rngs=rngs
        )
        self.v_proj = _linear(
            cfg, f"{prefix}.v_proj", d, cfg.n_kv_heads * hd, ("embed", "kv_heads"), rngs=rngs
        )
        self.o_proj = _linear(
            cfg,
            f"{prefix}.o_proj",
            cfg.n_heads * hd,
            d,
            ("heads", "embed"),
            rngs=rngs,
            std=_out_std(cfg),
        )

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, *, key: jax.Array | None = None
    ) -> jax.Array:
        b, t, _ = x.shape
        heads, kv = (
            ("act_batch", "act_length", "act_heads", None),
            ("act_batch", "act_length", "act_kv_heads", None),
        )
        q, k, v = _column(self, ("q_proj", "k_proj", "v_proj"), x, key)
        q = q.reshape(b, t, self.n_heads, self.head_dim)
        k = k.reshape(b, t, self.n_kv_heads, self.head_dim)
        v = v.reshape(b, t, self.n_kv_heads, self.head_dim)
        q, k, v = constrain(q, heads), constrain(k, kv), constrain(v, kv)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = constrain(causal_attention(q, k, v, chunk=self.attention_chunk), heads)
        o = checkpoint_name(o.reshape(b, t, self.n_heads * self.head_dim), "attn_out")
        return constrain(_row(self.o_proj, o, key), RESIDUAL)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; silu in float32."""

    def __init__(self, cfg: ModelConfig, prefix: str, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.gate_proj = _linear(cfg, f"{prefix}.gate_proj", d, f, ("embed", "mlp"), rngs=rngs)
        self.up_proj = _linear(cfg, f"{prefix}.up_proj", d, f, ("embed", "mlp"), rngs=rngs)
        self.down_proj = _linear(
            cfg, f"{prefix}.down_proj", f, d, ("mlp", "embed"), rngs=rngs, std=_out_std(cfg)
        )

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        hidden = ("act_batch", "act_length", "act_mlp")
        g, u = (constrain(y, hidden) for y in _column(self, ("gate_proj", "up_proj"), x, key))
        h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(g.dtype)
        return constrain(_row(self.down_proj, checkpoint_name(h, "mlp_hidden"), key), RESIDUAL)


class Block(nnx.Module):
    """Pre-norm transformer block: attention then MLP, each added to the residual."""

    def __init__(self, cfg: ModelConfig, index: int, *, rngs: nnx.Rngs):
        prefix = f"layers.{index}"
        norm: dict[str, Any] = dict(
            eps=cfg.norm_eps, param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype
        )
        self.attn_norm = RMSNorm(cfg.d_model, **norm)
        self.attn = Attention(cfg, f"{prefix}.attn", rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, **norm)
        self.mlp = MLP(cfg, f"{prefix}.mlp", rngs=rngs)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, *, key: jax.Array | None = None
    ) -> jax.Array:
        x = constrain(x, RESIDUAL)
        h = x + self.attn(self.attn_norm(x), cos, sin, key=key).astype(x.dtype)
        return constrain(h + self.mlp(self.mlp_norm(h), key=key).astype(h.dtype), RESIDUAL)


def _column(module: nnx.Module, names: tuple[str, ...], x: jax.Array, key) -> list[jax.Array]:
    """The outputs of ``module``'s column-parallel projections ``names`` on the block input
    ``x`` (one tensor-parallel group: `tensor_parallel.column_parallel`), each named "proj"
    for the ``save_dots`` remat policy."""
    layers = [getattr(module, n) for n in names]
    return [checkpoint_name(y, "proj") for y in column_parallel(layers, x, RESIDUAL, key=key)]


def _row(layer: QLinear, x: jax.Array, key) -> jax.Array:
    """A row-parallel projection's output (`tensor_parallel.row_parallel`), named "proj"."""
    return checkpoint_name(row_parallel(layer, x, RESIDUAL, key=key), "proj")


def _run_block(block: Block, x, cos, sin, key):
    return block(x, cos, sin, key=key)


# Remat policies (``model.remat``): what a block keeps for its backward pass, and the
# trade-off. Recomputed FLOPs and saved bytes per policy are in ``microscale.plan``.
REMAT_POLICIES = {
    # everything the backward needs stays live: most memory, no extra FLOPs
    "none": None,
    # the block input only; the backward recomputes the block's forward (every GEMM but
    # down_proj, whose output it does not need, and attention): least memory, +1 forward
    "full": jax.checkpoint_policies.nothing_saveable,
    # the seven projections' outputs stay; attention and the elementwise work (norms,
    # RoPE, SiLU, softmax) are recomputed: no GEMM runs twice
    "save_dots": jax.checkpoint_policies.save_only_these_names("proj"),
    # the attention output and the MLP hidden (o_proj's and down_proj's inputs) stay: the
    # attention's value product is not recomputed, every GEMM but down_proj is (o_proj for
    # the residual the MLP norm reads); memory between full and save_dots
    "minimal": jax.checkpoint_policies.save_only_these_names("attn_out", "mlp_hidden"),
}
_RUN = {
    name: _run_block if policy is None else nnx.remat(_run_block, policy=policy)
    for name, policy in REMAT_POLICIES.items()
}


# ---------------------------------------------------------------------- scanned layers
#
# ``model.scan_layers``: each contiguous run of blocks whose projections share their
# recipes runs as one ``jax.lax.scan`` over the blocks' parameters stacked on a new
# leading axis, so the step's program holds one block body per run instead of one per
# block and compile time barely grows with depth. The parameters stay per block
# (``layers.<i>...``) everywhere outside the forward pass (checkpoints, export, rules,
# PTQ): the stack is built inside the traced step (its transpose unstacks the gradient),
# at the cost of one transient copy of the blocks' local parameter shards. A block's
# static structure is shared by its run, except its projections' ``layer_id``\ s (the
# stochastic-rounding stream of each path), which the scan carries as data, so a scanned
# model draws exactly the bits of the unrolled one.


def _projections(block: Block) -> list[QLinear]:
    """The block's seven projections, in a fixed order."""
    return [
        block.attn.q_proj,
        block.attn.k_proj,
        block.attn.v_proj,
        block.attn.o_proj,
        block.mlp.gate_proj,
        block.mlp.up_proj,
        block.mlp.down_proj,
    ]


def scan_segments(layers) -> list[list[int]]:
    """Block indices grouped into contiguous runs whose projections have equal recipes
    (each run is one scan; a block unlike both neighbours runs alone)."""
    runs: list[list[int]] = []
    last = None
    for i, block in enumerate(layers):
        sig = tuple(p.recipe for p in _projections(block))
        if runs and sig == last:
            runs[-1].append(i)
        else:
            runs.append([i])
        last = sig
    return runs


def _scan_blocks(blocks: list[Block], x, cos, sin, key, remat: str):
    """``blocks`` (identical but for their parameters and layer ids) applied in order as
    one ``lax.scan`` over their stacked parameters; remat as configured, per block."""
    graphdef, _ = nnx.split(blocks[0])
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[nnx.state(b) for b in blocks])
    ids = jnp.asarray([[p.layer_id for p in _projections(b)] for b in blocks], jnp.int32)

    def body(x, xs):
        state, layer_ids = xs
        block = nnx.merge(graphdef, state)
        for proj, layer_id in zip(_projections(block), layer_ids, strict=True):
            proj.layer_id = layer_id
        return block(x, cos, sin, key=key), None

    policy = REMAT_POLICIES[remat]
    if policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    return jax.lax.scan(body, x, (stacked, ids))[0]


class Transformer(nnx.Module):
    """Llama-style decoder. ``model(tokens [B, T] int32, key=...) -> logits [B, T, V] f32``.

    ``rules`` assigns each projection its recipe (see `microscale.model.rules`); default
    every layer bf16. Change later with ``model.set_rules(rules)``.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, rules: PrecisionRules | None = None):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"Transformer: config={config!r}: expected a ModelConfig")
        self.config = config
        cfg = config
        self.embed = Embed(
            cfg.vocab_size,
            cfg.d_model,
            rngs=rngs,
            init_std=cfg.init_std,
            param_dtype=cfg.param_dtype,
            compute_dtype=cfg.compute_dtype,
        )
        self.layers = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.n_layers)])
        self.final_norm = RMSNorm(
            cfg.d_model,
            eps=cfg.norm_eps,
            param_dtype=cfg.param_dtype,
            compute_dtype=cfg.compute_dtype,
        )
        if not cfg.tie_embeddings:
            self.lm_head = LMHead(
                cfg.d_model,
                cfg.vocab_size,
                rngs=rngs,
                init_std=cfg.init_std,
                param_dtype=cfg.param_dtype,
                compute_dtype=cfg.compute_dtype,
            )
        self.rules = rules if rules is not None else PrecisionRules(default="bf16")
        apply_rules(self, self.rules)

    def set_attention_chunk(self, chunk: int) -> None:
        """Attend in query chunks of ``chunk`` positions in every block (0: all at once;
        :func:`causal_attention`); ``config.attention_chunk`` follows. The same function,
        with ``[B, H, chunk, S]`` float32 scores live per block instead of ``[B, H, T, S]``."""
        self.config = dataclasses.replace(self.config, attention_chunk=chunk)  # validates it
        for block in self.layers:
            block.attn.attention_chunk = self.config.attention_chunk

    def set_rules(self, rules: PrecisionRules) -> dict[str, str | None]:
        """Re-assign every projection's recipe (e.g. the late switch); returns
        {path: recipe name}. Static attributes change, so jit retraces."""
        self.rules = rules
        return apply_rules(self, rules)

    def set_recipe(self, recipe: RecipeLike) -> dict[str, str | None]:
        """Every projection in ``recipe`` (no per-layer exceptions)."""
        return self.set_rules(PrecisionRules(default=recipe))

    def __call__(
        self, tokens: jax.Array, *, key: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        """tokens ``[B, T]`` int -> float32 logits ``[B, T, vocab]``.

        ``key``: PRNG key for stochastic rounding / per-step randomness of the recipes.
        ``positions``: optional ``[T]`` or ``[B, T]`` RoPE positions (default ``arange(T)``).
        """
        return self.logits(self.features(tokens, key=key, positions=positions))

    def features(
        self, tokens: jax.Array, *, key: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        """tokens ``[B, T]`` -> the final-normed residual stream ``[B, T, d_model]``, the
        input of the LM head (`logits`)."""
        cfg = self.config
        if tokens.ndim != 2:
            raise ValueError(f"Transformer: tokens shape {tokens.shape}: expected [batch, seq]")
        t = tokens.shape[1]
        if t > cfg.max_seq_len:
            raise ValueError(
                f"Transformer: sequence length {t} exceeds max_seq_len={cfg.max_seq_len}"
            )
        if positions is None:
            positions = jnp.arange(t)
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        x = constrain(self.embed(tokens), RESIDUAL)
        run = _RUN[str(cfg.remat)]  # a str once ModelConfig has normalized it
        if not cfg.scan_layers:
            for block in self.layers:
                x = run(block, x, cos, sin, key)
            return self.final_norm(x)
        for seg in scan_segments(self.layers):
            blocks = [self.layers[i] for i in seg]
            x = (
                run(blocks[0], x, cos, sin, key)
                if len(blocks) == 1
                else _scan_blocks(blocks, x, cos, sin, key, str(cfg.remat))
            )
        return self.final_norm(x)

    def logits(self, x: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """The LM head: ``[B, T, d_model]`` -> float32 logits ``[B, T, vocab]``. ``head``:
        its weight as `gathered_head` returned it (default: the parameter)."""
        logits = self.embed.attend(x, head) if self.config.tie_embeddings else self.lm_head(x, head)
        return constrain(logits, ("act_batch", "act_length", "act_vocab"))

    def gathered_head(self) -> jax.Array:
        """The LM head's weight gathered over the data axes once (kept split on ``tensor``
        over the vocabulary), for a loss that calls `logits` per chunk: inside a loop the
        partitioner would gather it, and reduce its gradient, once per chunk."""
        if self.config.tie_embeddings:
            return constrain(self.embed.embedding[...], ("act_vocab", "act_embed"))
        return constrain(self.lm_head.kernel[...], ("act_embed", "act_vocab"))
