"""A decoder-only transformer in Flax NNX whose linear layers train in any microscale
recipe, for every family of `microscale.model.family` (Llama, Mistral, Qwen2, Qwen3,
Gemma 3).

The modules here hold the parameters; the block's arithmetic is
`microscale.model.block.block_forward`, which the inference engine runs too. Per block
(pre-norm, residual stream in float32)::

    h   = x + o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))  n = attn_norm(x)
    out = h + down_proj(silu(gate_proj(m)) * up_proj(m))                     m = mlp_norm(h)

with the family's q/k/v biases, per-head q/k norms, sliding window, post-norms and
activation where it has them (`microscale.model.block` has the whole list).
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
    layers.<i>.attn.<q|k|v>_proj.bias       [H*hd | KV*hd]        ('heads' | 'kv_heads')  (qwen2)
    layers.<i>.attn.<q|k>_norm.scale        [hd]                  ('norm',)  (qwen3)
    layers.<i>.attn.o_proj.kernel           [H*hd, d_model]       ('heads', 'embed')
    layers.<i>.attn_post_norm.scale         [d_model]             ('norm',)  (gemma3)
    layers.<i>.mlp_norm.scale               [d_model]             ('norm',)
    layers.<i>.mlp_post_norm.scale          [d_model]             ('norm',)  (gemma3)
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
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from microscale.model.block import (
    RESIDUAL,
    block_forward,
    causal_attention,
    embed_residual,
    layer_rope_tables,
)
from microscale.model.config import ModelConfig
from microscale.model.layers import Embed, LMHead, QLinear, RMSNorm
from microscale.model.rules import PrecisionRules, RecipeLike, apply_rules, path_id
from microscale.model.sharding import constrain
from microscale.model.tensor_parallel import column_parallel, row_parallel

__all__ = [
    "BLOCK_LINEARS",
    "FUSED_LINEARS",
    "MLP",
    "Attention",
    "Block",
    "Transformer",
    "block_param_shapes",
    "causal_attention",
    "fused_groups",
    "linear_paths",
    "param_shapes",
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


def block_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{path inside a block: shape} of every parameter of one `Block` of ``cfg``: its
    norms, its seven kernels ``[in, out]``, and the family's biases and q/k norms."""
    d, f, hd = cfg.d_model, cfg.d_ff, cfg.head_dim
    qd, kvd = cfg.n_heads * hd, cfg.n_kv_heads * hd
    shapes = [(d, qd), (d, kvd), (d, kvd), (qd, d), (d, f), (d, f), (f, d)]
    lin = dict(zip(BLOCK_LINEARS, shapes, strict=True))
    norms = ("attn_norm", "mlp_norm") + (("attn_post_norm", "mlp_post_norm") * cfg.arch.post_norms)
    out: dict[str, tuple[int, ...]] = {f"{n}.scale": (d,) for n in norms}
    out |= {f"{k}.kernel": shp for k, shp in lin.items()}
    if cfg.arch.qkv_bias:
        out |= {f"{k}.bias": (lin[k][1],) for k in BLOCK_LINEARS[:3]}
    if cfg.arch.qk_norm:
        out |= {"attn.q_norm.scale": (hd,), "attn.k_norm.scale": (hd,)}
    return out


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{parameter path: shape} of every parameter of ``Transformer(cfg)``."""
    out: dict[str, tuple[int, ...]] = {
        "embed.embedding": (cfg.vocab_size, cfg.d_model),
        "final_norm.scale": (cfg.d_model,),
    }
    if not cfg.tie_embeddings:
        out["lm_head.kernel"] = (cfg.d_model, cfg.vocab_size)
    block = block_param_shapes(cfg)
    for i in range(cfg.n_layers):
        out |= {f"layers.{i}.{k}": shp for k, shp in block.items()}
    return out


def filled(abstract: Any, params: Mapping[str, Any], dtype: Any) -> Any:
    """The module ``abstract`` (from ``nnx.eval_shape``) holding ``params`` (a flat dict
    by dotted parameter path) in ``dtype``, without a random init. A missing parameter
    raises KeyError, a wrong shape ValueError, each naming the path."""
    graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)  # type: ignore[misc]
    flat = []
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(p) for p in path)
        if name not in params:
            raise KeyError(f"parameter {name!r} is missing")
        value = jnp.asarray(np.asarray(params[name]), dtype)
        if value.shape != var.shape:
            raise ValueError(f"parameter {name!r} has shape {value.shape}; expected {var.shape}")
        flat.append((path, var.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat), rest)


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


def _linear(
    cfg: ModelConfig,
    path: str,
    din: int,
    dout: int,
    axes,
    *,
    rngs: nnx.Rngs,
    std: float | None = None,
    bias: bool = False,
) -> QLinear:
    return QLinear(
        din,
        dout,
        rngs=rngs,
        bias=bias,
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
    """The attention's parameters: q/k/v/o `QLinear`\\ s (q/k/v with biases, and per-head
    q/k norms, where the family has them). `microscale.model.block` computes with them."""

    def __init__(self, cfg: ModelConfig, index: int, *, rngs: nnx.Rngs):
        d, hd, fam = cfg.d_model, cfg.head_dim, cfg.arch
        prefix = f"layers.{index}.attn"
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, hd
        self.attention_chunk = cfg.attention_chunk
        self.window = cfg.layer_window(index)
        self.scale = cfg.attn_scale
        qkv: dict[str, Any] = dict(rngs=rngs, bias=fam.qkv_bias)
        self.q_proj = _linear(
            cfg, f"{prefix}.q_proj", d, cfg.n_heads * hd, ("embed", "heads"), **qkv
        )
        self.k_proj = _linear(
            cfg, f"{prefix}.k_proj", d, cfg.n_kv_heads * hd, ("embed", "kv_heads"), **qkv
        )
        self.v_proj = _linear(
            cfg, f"{prefix}.v_proj", d, cfg.n_kv_heads * hd, ("embed", "kv_heads"), **qkv
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
        if fam.qk_norm:
            self.q_norm = _norm(cfg, hd)
            self.k_norm = _norm(cfg, hd)


class MLP(nnx.Module):
    """The gated MLP's parameters (SwiGLU, or GeGLU for Gemma): gate/up/down `QLinear`\\ s."""

    def __init__(self, cfg: ModelConfig, prefix: str, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.gate_proj = _linear(cfg, f"{prefix}.gate_proj", d, f, ("embed", "mlp"), rngs=rngs)
        self.up_proj = _linear(cfg, f"{prefix}.up_proj", d, f, ("embed", "mlp"), rngs=rngs)
        self.down_proj = _linear(
            cfg, f"{prefix}.down_proj", f, d, ("mlp", "embed"), rngs=rngs, std=_out_std(cfg)
        )


def _norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return RMSNorm(
        dim,
        eps=cfg.norm_eps,
        offset=cfg.arch.norm_offset,
        param_dtype=cfg.param_dtype,
        compute_dtype=cfg.compute_dtype,
    )


class Block(nnx.Module):
    """One decoder block's parameters; ``block(x, cos, sin, key=...)`` runs
    `microscale.model.block.block_forward` on them (training's `BlockOps`)."""

    def __init__(self, cfg: ModelConfig, index: int, *, rngs: nnx.Rngs):
        self.config = cfg
        self.local = cfg.layer_is_local(index)  # a local layer (window, own RoPE base)
        self.attn_norm = _norm(cfg, cfg.d_model)
        self.attn = Attention(cfg, index, rngs=rngs)
        self.mlp_norm = _norm(cfg, cfg.d_model)
        self.mlp = MLP(cfg, f"layers.{index}.mlp", rngs=rngs)
        if cfg.arch.post_norms:
            self.attn_post_norm = _norm(cfg, cfg.d_model)
            self.mlp_post_norm = _norm(cfg, cfg.d_model)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, *, key: jax.Array | None = None
    ) -> jax.Array:
        return block_forward(self.config, _TrainOps(self, key), x, cos, sin)


@dataclasses.dataclass(frozen=True)
class _TrainOps:
    """`BlockOps` of a `Block`: its QLinears through the recipes (tensor-parallel
    groups under a mesh: `tensor_parallel`), its parameters, and causal attention over
    the sequence (in query chunks of ``attn.attention_chunk``)."""

    block: Block
    key: jax.Array | None

    def _get(self, name: str) -> Any:
        obj: Any = self.block
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj

    def column(self, names, x):
        layers = [self._get(n) for n in names]
        outs = column_parallel(layers, x, RESIDUAL, key=self.key)
        return [checkpoint_name(y, "proj") for y in outs]

    def row(self, name, x):
        return checkpoint_name(row_parallel(self._get(name), x, RESIDUAL, key=self.key), "proj")

    def param(self, name):
        return self._get(name)[...]

    def attend(self, q, k, v):
        attn = self.block.attn
        return causal_attention(
            q, k, v, chunk=attn.attention_chunk, window=attn.window, scale=attn.scale
        )


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
# static structure is shared by its run, except its projections' ``layer_id``\\ s (the
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
    and whose attention is alike (local or global; each run is one scan; a block unlike
    both neighbours runs alone)."""
    runs: list[list[int]] = []
    last = None
    for i, block in enumerate(layers):
        sig = (block.local, *(p.recipe for p in _projections(block)))
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
        self.final_norm = _norm(cfg, cfg.d_model)
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
        tables = layer_rope_tables(cfg, positions)
        x = constrain(embed_residual(cfg, self.embed(tokens)), RESIDUAL)
        run = _RUN[str(cfg.remat)]  # a str once ModelConfig has normalized it
        if not cfg.scan_layers:
            for block, (cos, sin) in zip(self.layers, tables, strict=True):
                x = run(block, x, cos, sin, key)
            return self.final_norm(x)
        for seg in scan_segments(self.layers):
            blocks = [self.layers[i] for i in seg]
            cos, sin = tables[seg[0]]  # a run's blocks are alike (local or global)
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
