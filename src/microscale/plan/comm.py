"""What a sharded train step must communicate and compute: the analytic figures that the
compiled program (``plan.compile``) is held against.

Bytes are per device per optimizer step, moved on ring collectives over a group of ``n``
devices (as ``plan.hlo`` counts the compiled ones): an all-gather of a result of ``S``
bytes moves ``S (n-1)/n``; a reduce-scatter of an input of ``S`` bytes moves
``S (n-1)/n``; an all-reduce of ``S`` bytes ``2 S (n-1)/n``.

Mesh ``(data D, fsdp F, tensor T)``; ``M`` microbatches (``data.grad_accum``) of ``Tm``
tokens per device; ``L`` blocks; parameters as the trainer shards them
(``model.sharding``): every kernel's ``d_model`` side on ``fsdp``, its heads / d_ff /
vocab side on ``tensor``; norms replicated. Weights move as stored (float32 master
weights: the cast to the compute dtype happens inside each GEMM's VJP, after the gather).

ZeRO-3 (``F > 1``), per microbatch:

* forward: every block kernel and the embedding table are gathered over ``fsdp`` before
  their GEMM (``size/T (F-1)/F`` each); the LM head once for its forward and its input
  gradient, which follows at once;
* backward: every block kernel is gathered again (ZeRO-3 frees the gathered weights after
  the forward; the embedding's backward is a scatter-add into its shard and needs no
  gather);
* remat (``model.remat``): the recomputed forward gathers the kernels of the GEMMs it
  recomputes once more. ``full``: every block kernel except ``down_proj`` (a block's last
  GEMM is not recomputed: its output is not needed in the backward pass); ``minimal``:
  the same (o_proj's output is recomputed for the residual the MLP norm needs);
  ``save_dots``: none (no GEMM is recomputed);
* gradients: a reduce-scatter over ``fsdp`` of every float32 gradient
  (``size/T (F-1)/F``); with ``D > 1`` also an all-reduce over ``data`` of the shard.
  Replicated parameters (norms) all-reduce over ``data x fsdp``.

Megatron tensor parallelism (``T > 1``) with sequence parallelism (the residual stream,
its norms and the saved block inputs split along the sequence over ``tensor``, when
``seq_len`` divides), per microbatch: the norm's output is all-gathered along the sequence
before q/k/v and before gate/up, and o_proj's and down_proj's partial sums are
reduce-scattered back (2 of each per block, forward); the backward transposes each (2
reduce-scatters of the column-parallel input gradients, 2 all-gathers of the row-parallel
output gradients); remat's recomputed forward gathers both inputs again and, under
``full`` and ``minimal``, reduce-scatters o_proj's output. A reduce-scatter plus an
all-gather move what one all-reduce does. Without sequence parallelism (``seq_len`` not
divisible by ``T``): column-parallel q/k/v and
gate/up need no collective in the forward; row-parallel o_proj and down_proj all-reduce
their ``[Tm, d_model]`` float32 output (2 per block); in the backward the input
gradients of the column-parallel groups are all-reduced (2 per block: one for q/k/v,
one for gate/up). The vocab-parallel embedding all-reduces its lookup and the LM head its
input gradient; the cross-entropy's row reductions are small. Remat adds the recomputed
o_proj's all-reduce under ``full`` and ``minimal`` (1 per block; down_proj is not
recomputed).

Data parallelism (``D > 1``, ``F = T = 1``): one all-reduce of every float32 gradient.

FLOPs (`matmul_flops`): ``6 N Tm`` for the matmul parameters (the three GEMMs of every
linear layer and the LM head) plus causal-unmasked attention ``12 L d T`` per token, as
``ModelConfig.flops_per_token``; remat adds the forward it recomputes (``2 Tm`` per
parameter of a recomputed GEMM, ``2 L d T`` per token for each attention product):
``full`` every block GEMM but ``down_proj`` and both attention products; ``save_dots``
both attention products (``o_proj``'s input is not saved); ``minimal`` every block GEMM
but ``down_proj`` (o_proj too: the residual ``h`` that the MLP's norm reads is recomputed)
and the scores ``Q K^T`` only. Attention in query chunks (``model.attention_chunk``)
recomputes each chunk's scores ``Q K^T`` in the backward (``2 L d T`` per token), except
under ``minimal``, whose recomputation already holds them. The loss in chunks
(``model.loss_chunk``) recomputes each chunk's logits in the backward (``2 d V`` per
token).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["KINDS", "analytic_collectives", "cpu_volume", "matmul_flops"]

KINDS = ("all-gather", "reduce-scatter", "all-reduce")


def _ring(kind: str, size: float, n: int) -> float:
    if n <= 1:
        return 0.0
    return size * (n - 1) / n * (2 if kind == "all-reduce" else 1)


def _zero3_rows(add: Callable[..., None], cfg, mesh: dict[str, int]) -> None:
    """ZeRO-3 rows: fsdp weight gathers (forward, backward, remat) and gradient reductions."""
    m = cfg.model
    d, f, v, L = m.d_model, m.d_ff, m.vocab_size, m.n_layers
    hd = m.head_dim
    D, F, T = mesh["data"], mesh["fsdp"], mesh["tensor"]
    M = cfg.data.grad_accum
    pb = np.dtype(m.param_dtype).itemsize  # stored weight bytes
    attn = d * (m.n_heads * hd) * 2 + d * (m.n_kv_heads * hd) * 2
    block = L * (attn + 3 * d * f)  # block kernels
    down = L * d * f
    table = v * d
    head = 0 if m.tie_embeddings else v * d
    norms = (2 * L + 1) * d
    sharded = block + table + head
    # ZeRO-3 over fsdp
    add("fsdp: gather block weights, forward", "all-gather", block * pb / T, F, M)
    add(
        "fsdp: gather embedding (and tied head), forward",
        "all-gather",
        table * pb / T,
        F,
        M * (2 if m.tie_embeddings else 1),
    )
    if head:
        add("fsdp: gather LM head, forward + input gradient", "all-gather", head * pb / T, F, M)
    add("fsdp: gather block weights, backward", "all-gather", block * pb / T, F, M)
    regathered = {
        "none": 0,
        "save_dots": 0,
        "full": block - down,  # GEMMs recomputed
        "minimal": block - down,
    }[m.remat]
    if regathered:
        add(
            f"fsdp: gather block weights, remat {m.remat} (the recomputed GEMMs')",
            "all-gather",
            regathered * pb / T,
            F,
            M,
        )
    add("fsdp: reduce-scatter gradients (float32)", "reduce-scatter", sharded * 4 / T, F, M)
    add("data: all-reduce gradient shards (float32)", "all-reduce", sharded * 4 / (T * F), D, M)
    add("data x fsdp: all-reduce replicated gradients (norms)", "all-reduce", norms * 4, D * F, M)


def _tensor_rows(add: Callable[..., None], cfg, mesh: dict[str, int]) -> None:
    """Megatron rows: block activation all-reduces (or their sequence-parallel halves) and
    the vocab-parallel embedding and head."""
    m = cfg.model
    D, F, T = mesh["data"], mesh["fsdp"], mesh["tensor"]
    M, L = cfg.data.grad_accum, m.n_layers
    tm = cfg.data.batch_size // M * cfg.data.seq_len / (D * F)  # tokens per device
    act = tm * m.d_model * 4
    o_again = m.remat in ("full", "minimal")
    if cfg.data.seq_len % T:  # the residual stays whole on each tensor rank
        add(
            "tensor: all-reduce block activations (o/down forward, q/k/v and gate/up "
            "input gradients" + (", remat o_proj" if o_again else "") + ")",
            "all-reduce",
            act,
            T,
            M * L * (4 + o_again),
        )
    else:  # sequence parallelism: each all-reduce is a reduce-scatter + an all-gather
        regather = {"none": 0, "save_dots": 0, "full": 2, "minimal": 2}[m.remat]
        add(
            "tensor (sequence parallel): all-gather block inputs (q/k/v and gate/up "
            "forward, o/down input gradients" + (", remat" if regather else "") + ")",
            "all-gather",
            act,
            T,
            M * L * (4 + regather),
        )
        add(
            "tensor (sequence parallel): reduce-scatter block outputs (o/down forward, "
            "q/k/v and gate/up input gradients" + (", remat o_proj" if o_again else "") + ")",
            "reduce-scatter",
            act,
            T,
            M * L * (4 + o_again),
        )
    add(
        "tensor: all-reduce vocab-parallel embedding lookup and LM head input gradient",
        "all-reduce",
        act,
        T,
        2 * M,
    )


def analytic_collectives(cfg, mesh: dict[str, int]) -> dict[str, Any]:
    """``{"rows": [(what, kind, bytes)], "by_kind": {kind: bytes}, "total": bytes,
    "cpu_total": bytes}`` per device per step for ``cfg`` (a TrainConfig) on ``mesh``
    ({axis: size}); see the module doc for each row's reasoning. ``cpu_total`` is the
    same volume as XLA:CPU lowers it: it has no reduce-scatter and emits an all-reduce
    (then a slice), which moves twice the bytes, so the compiled program on simulated CPU
    devices is held against ``cpu_total`` and a GPU's against ``total``."""
    rows: list[tuple[str, str, float]] = []

    def add(what: str, kind: str, size: float, n: int, times: float = 1.0) -> None:
        b = times * _ring(kind, size, n)
        if b:
            rows.append((what, kind, b))

    _zero3_rows(add, cfg, mesh)
    _tensor_rows(add, cfg, mesh)
    by_kind = {k: sum(b for _, kk, b in rows if kk == k) for k in KINDS}
    total = sum(by_kind.values())
    return {
        "rows": rows,
        "by_kind": by_kind,
        "total": total,
        "cpu_total": total + by_kind["reduce-scatter"],
    }


def cpu_volume(analytic: dict[str, Any], compiled_by_kind: dict[str, float]) -> float:
    """The analytic volume as one compiled XLA:CPU program lowers it: the partitioner's
    reduce-scatters become all-reduces on XLA:CPU (twice the bytes), while one written out
    under ``shard_map`` stays a reduce-scatter; so each analytic reduce-scatter byte the
    program does not keep as a reduce-scatter counts twice (``cpu_total`` when it keeps
    none, ``total`` when it keeps them all)."""
    kept = min(analytic["by_kind"]["reduce-scatter"], compiled_by_kind.get("reduce-scatter", 0.0))
    return analytic["cpu_total"] - kept


def matmul_flops(cfg, devices: int) -> float:
    """Matmul FLOPs per device per step: ``6N`` + attention (``ModelConfig``), plus the
    forward that remat recomputes (module doc)."""
    m = cfg.model
    t = cfg.data.seq_len
    tokens = cfg.data.batch_size * t / devices
    flops = m.flops_per_token(t) * tokens
    d, hd, L = m.d_model, m.head_dim, m.n_layers
    q_kv = d * (m.n_heads * hd) + d * (m.n_kv_heads * hd) * 2
    params, attn = {
        "none": (0, 0),
        "save_dots": (0, 4),  # recomputed GEMM params, attn
        "full": (q_kv + d * (m.n_heads * hd) + 2 * d * m.d_ff, 4),
        "minimal": (q_kv + d * (m.n_heads * hd) + 2 * d * m.d_ff, 2),
    }[m.remat]
    if 0 < m.attention_chunk < t and m.remat != "minimal":
        attn += 2  # chunked attention recomputes its scores Q K^T in the backward
    head = 2 * d * m.vocab_size if 0 < m.loss_chunk < t else 0  # chunked loss: logits again
    return flops + 2 * L * params * tokens + attn * L * d * t * tokens + head * tokens
