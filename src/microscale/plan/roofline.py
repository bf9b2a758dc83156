"""A roofline step-time model per recipe, from published peak rates (`plan.hardware`).

One training step on one device is a sum of terms, each at the accelerator's peak:

* **gemm** -- the three GEMMs of every linear layer (fprop ``2MKN``, dgrad and wgrad
  the same; fprop once more when blocks are rematerialised), each
  ``max(flops / peak(bits), operand+output bytes / HBM bandwidth)``, where ``bits`` is the
  widest operand's element width (``FormatSpec.elem_bits``: 16 -> BF16 rate, 8 -> FP8,
  4 -> FP4). ``M`` is the device's tokens, ``K``/``N`` the kernel's dims divided by the
  mesh axes that shard them for compute (``tensor``; ``fsdp`` shards are gathered first).
* **quantize** -- memory traffic of the operand passes: each of the six operand slots
  that is quantized reads its bf16 input and writes its elements and block scales
  (``FormatSpec.bits_per_element``); a slot served by an identical quantized copy (the
  same transpose-invariant spec on the same tensor: W for dgrad, X for FP8's wgrad) costs
  nothing; a per-tensor scale (``has_tensor_scale``) costs one more read for its amax; a
  random Hadamard transform adds ``2 * size`` FLOPs per element (a 16x16 matmul per
  16 values) at the BF16 rate, in the quantize pass and in its amax pass.
  "fused" variant: each tensor (X, W, dY) read once for all its slots, as Transformer
  Engine's cast-transpose kernels do; the writes stay.
* **attention** -- ``QK^T`` and ``PV`` in BF16: ``12 * L * d * T`` FLOPs per token (the
  model's `ModelConfig.flops_per_token` convention: causal masking not halved; this model
  computes full scores) plus a third more with remat (the forward is 4 of the 12),
  split over ``tensor``.
* **lm_head** -- ``6 * d * V`` FLOPs per token in BF16 (plus the embedding's gradient).
* **elementwise** -- norms, SwiGLU, RoPE, residual adds (about ``40 d + 6 d_ff`` bytes
  per token and layer forward, backward twice that, once more with remat; the ``d`` part
  split over ``tensor`` by sequence parallelism, the ``d_ff`` part by the MLP's columns)
  and the float32
  logits' softmax cross-entropy (``12 V`` bytes per token), at HBM bandwidth.
* **optimizer** -- AdamW on the device's float32 shard: 28 bytes per parameter (read
  p, g, m, v; write p, m, v) plus 8 bytes per microbatch for the float32 gradient sum.

Collectives are reported beside the sum (``comm``: per-device bytes / NVLink bandwidth),
not in it: they overlap with compute when the framework schedules them well, and beyond
one NVLink domain they run at network rates this table does not hold.

Ratios are ``t(baseline) / t(recipe)``: > 1 means the recipe is faster. The GEMM-only ratio
is what the 2x FP4/FP8 tensor-core rate promises; the other terms are why a step gets less.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from microscale.ops import get_recipe
from microscale.plan.hardware import Accelerator

__all__ = ["LinearShape", "linear_shapes", "recipe_step_time", "roofline"]

COMPUTE_BYTES = 2  # bf16 activations / gradients / operand inputs
TERMS = ("gemm", "quantize", "attention", "lm_head", "elementwise", "optimizer")
# Which tensor each operand slot reads, and its element count in terms of (M, K, N).
_SLOT_TENSOR = {
    "fprop_x": "X",
    "wgrad_x": "X",
    "fprop_w": "W",
    "dgrad_w": "W",
    "dgrad_dy": "dY",
    "wgrad_dy": "dY",
}
_TENSOR_SIZE = {"X": lambda m, k, n: m * k, "W": lambda m, k, n: k * n, "dY": lambda m, k, n: m * n}


@dataclasses.dataclass(frozen=True)
class LinearShape:
    """One linear layer as a device sees it."""

    path: str  # dotted module path
    k: int  # input features on this device (compute shard)
    n: int  # output features on this device (compute shard)
    k_full: int  # global input features
    n_full: int  # global output features


def _compute_share(axes, shape, mesh: dict[str, int], batch_axes) -> tuple[int, int]:
    from microscale.model import logical_to_mesh_spec

    spec = logical_to_mesh_spec(axes, shape, mesh)
    out = []
    for dim, s in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True):
        names = () if s is None else (s,) if isinstance(s, str) else tuple(s)
        split = math.prod(mesh[a] for a in names if a not in batch_axes)
        out.append(dim // split)
    return out[0], out[1]


def linear_shapes(model_cfg, mesh: dict[str, int], model=None) -> list[LinearShape]:
    """Every linear layer of the model with its per-device compute shard (``model``: the
    abstract Transformer, built from ``model_cfg`` when None; nothing allocated)."""
    from flax import nnx

    from microscale.model import Transformer, iter_linears, logical_to_mesh_rules
    from microscale.model.sharding import var_logical_axes

    batch_axes = dict(logical_to_mesh_rules())["batch"]
    if model is None:
        model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    out = []
    for path, node in iter_linears(model):
        shape = tuple(node.kernel.get_value().shape)
        k, n = _compute_share(var_logical_axes(node.kernel), shape, mesh, batch_axes)
        out.append(LinearShape(path=path, k=k, n=n, k_full=shape[0], n_full=shape[1]))
    return out


def _quantize_bytes(recipe, m: int, k: int, n: int, *, fused: bool) -> tuple[float, float]:
    """(HBM bytes, RHT FLOPs) of one linear layer's operand quantization passes."""
    ops = recipe.operands()
    served: set[str] = set()
    write = 0.0
    amax_reads: set[tuple[str, int | None]] = set()
    reads: dict[str, int] = {}
    flops = 0.0
    for slot, spec in ops.items():
        if not spec.quantized:
            continue
        tensor = _SLOT_TENSOR[slot]
        twin = next(
            (
                s
                for s in served
                if _SLOT_TENSOR[s] == tensor and ops[s] == spec and spec.transpose_invariant
            ),
            None,
        )
        if twin is not None:
            continue
        served.add(slot)
        size = _TENSOR_SIZE[tensor](m, k, n)
        write += size * spec.spec.bits_per_element / 8
        reads[tensor] = reads.get(tensor, 0) + 1
        if spec.hadamard:
            flops += 2.0 * spec.hadamard * size
        if spec.spec.has_tensor_scale and (tensor, spec.hadamard) not in amax_reads:
            amax_reads.add((tensor, spec.hadamard))
            if spec.hadamard:
                flops += 2.0 * spec.hadamard * size
    read = 0.0
    for tensor, count in reads.items():
        read += _TENSOR_SIZE[tensor](m, k, n) * COMPUTE_BYTES * (1 if fused else count)
    read += sum(_TENSOR_SIZE[t](m, k, n) * COMPUTE_BYTES for t, _ in amax_reads)
    return read + write, flops


def recipe_step_time(
    cfg,
    mesh: dict[str, int],
    acc: Accelerator,
    recipe: str,
    *,
    linears: list[LinearShape] | None = None,
    fused: bool = False,
) -> dict[str, Any]:
    """Per-device step time terms (seconds) of ``cfg`` (a TrainConfig) trained with
    ``recipe`` (its precision rules: ``cfg.precision``) on ``acc``.
    ``{"terms": {...}, "total": s, "supported": bool, "missing": [...]}``; an
    unsupported recipe (a GEMM width the accelerator has no tensor cores for) has no
    total."""
    model = cfg.model
    rules = dataclasses.replace(cfg, recipe=recipe).precision_rules()
    linears = linear_shapes(model, mesh) if linears is None else linears
    dp = mesh.get("data", 1) * mesh.get("fsdp", 1)
    tp = mesh.get("tensor", 1)
    tokens = cfg.data.batch_size * cfg.data.seq_len / dp  # this device's tokens per step
    refwd = 0 if model.remat == "none" else 1  # (an upper bound for save_dots/minimal)
    terms = dict.fromkeys(TERMS, 0.0)
    missing: set[int] = set()
    bf16 = acc.peak(16)
    assert bf16 is not None  # every accelerator has a 16-bit peak
    for lin in linears:
        r = get_recipe(rules.resolve(lin.path) or "bf16")
        for gemm, (sa, sb) in r.gemms().items():
            bits = max(sa.spec.elem_bits, sb.spec.elem_bits)
            peak = acc.peak(bits)
            if peak is None:
                missing.add(bits)
                continue
            m, k, n = tokens, lin.k, lin.n
            a_el, b_el = {
                "fprop": (m * k, k * n),
                "dgrad": (m * n, k * n),
                "wgrad": (k * m, m * n),
            }[gemm]
            nbytes = (a_el * sa.spec.bits_per_element + b_el * sb.spec.bits_per_element) / 8
            nbytes += {"fprop": m * n, "dgrad": m * k, "wgrad": k * n}[gemm] * COMPUTE_BYTES
            t = max(2.0 * m * k * n / peak, nbytes / acc.hbm_bw)
            terms["gemm"] += t * (1 + refwd if gemm == "fprop" else 1)
        qbytes, qflops = _quantize_bytes(r, tokens, lin.k, lin.n, fused=fused)
        # Remat re-quantizes fprop's X (and W) when it recomputes the forward.
        if refwd:
            fwd_only = r.forward_only()
            b2, f2 = _quantize_bytes(fwd_only, tokens, lin.k, lin.n, fused=fused)
            qbytes, qflops = qbytes + b2, qflops + f2
        terms["quantize"] += qbytes / acc.hbm_bw + qflops / bf16
    d, f, v, L = model.d_model, model.d_ff, model.vocab_size, model.n_layers
    t_seq = cfg.data.seq_len
    attn = 12.0 * L * d * t_seq * (1 + refwd / 3) * tokens / tp  # fwd is 4 of the 12
    terms["attention"] = attn / bf16
    head = 6.0 * d * v * tokens / tp
    terms["lm_head"] = head / bf16
    sp = tp if t_seq % tp == 0 else 1  # sequence parallelism splits the residual's work
    per_layer = (40 * d / sp + 6 * f / tp) * (3 + refwd)  # per token: fwd, 2x bwd, remat
    terms["elementwise"] = (L * per_layer + 12 * v / tp) * tokens / acc.hbm_bw
    local_params = sum(lin.k_full * lin.n_full for lin in linears) / (dp * tp)
    local_params += (v * d * (1 if model.tie_embeddings else 2)) / (dp * tp)
    terms["optimizer"] = local_params * (28 + 8 * cfg.data.grad_accum) / acc.hbm_bw
    supported = not missing
    return {
        "recipe": recipe,
        "terms": terms,
        "supported": supported,
        "missing_bits": sorted(missing),
        "total": sum(terms.values()) if supported else None,
        "tokens_per_device": tokens,
    }


def roofline(
    cfg,
    mesh: dict[str, int],
    acc: Accelerator,
    recipes: tuple[str, ...] = ("bf16", "fp8", "nvfp4"),
    *,
    comm_bytes: float | None = None,
    model=None,
) -> dict[str, Any]:
    """Step-time terms of each recipe, and the speed-up of the last recipe over each other
    one: total, GEMMs only, and with fused (one read per tensor) quantization. ``model``:
    the abstract Transformer of ``cfg.model`` if already built."""
    linears = linear_shapes(cfg.model, mesh, model)
    rows = {r: recipe_step_time(cfg, mesh, acc, r, linears=linears) for r in recipes}
    fused = {r: recipe_step_time(cfg, mesh, acc, r, linears=linears, fused=True) for r in recipes}
    target = recipes[-1]
    ratios: dict[str, dict[str, float] | None] = {}
    for base in recipes[:-1]:
        a, b = rows[base], rows[target]
        if not (a["supported"] and b["supported"]):
            ratios[base] = None
            continue
        ratios[base] = {
            "step": a["total"] / b["total"],
            "gemm_only": a["terms"]["gemm"] / b["terms"]["gemm"],
            "step_fused_quantize": fused[base]["total"] / fused[target]["total"],
            "step_without_quantize": (
                (a["total"] - a["terms"]["quantize"]) / (b["total"] - b["terms"]["quantize"])
            ),
        }
    out: dict[str, Any] = {
        "accelerator": acc.name,
        "recipes": rows,
        "fused": fused,
        "target": target,
        "speedup": ratios,
    }
    if comm_bytes is not None:
        out["comm_s"] = comm_bytes / acc.link_bw
    return out
