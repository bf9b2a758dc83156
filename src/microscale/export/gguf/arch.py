"""What llama.cpp's graph of each ``general.architecture`` reads: one :class:`Arch` row each,
the GGUF names of microscale's parameters, the row order of q/k, and the refusals.

Families (:mod:`microscale.model.family`) go out as llama.cpp's converter
(``convert_hf_to_gguf.py``) writes their HF checkpoints; :data:`ARCHS` holds what each
``general.architecture``'s graph reads (llama.cpp's ``src/models/<arch>.cpp``)::

    family   general.architecture  extra tensors per block             q/k rows
    llama    llama                 -                                   permuted
    mistral  llama                 -                                   permuted
    qwen2    qwen2                 attn_{q,k,v}.bias [out] F32         as HF
    qwen3    qwen3                 attn_{q,k}_norm.weight [hd] F32     as HF
    gemma3   gemma3                attn_{q,k}_norm.weight [hd] F32,    as HF
                                   post_attention_norm.weight,
                                   post_ffw_norm.weight [d] F32

llama.cpp's ``llama`` graph uses RoPE on adjacent pairs (``LLAMA_ROPE_TYPE_NORM``),
microscale (and HF) on halves (``i`` with ``i + hd/2``), so for it the rows of q_proj and
k_proj are permuted per head to ``0, hd/2, 1, hd/2 + 1, ...`` (``LlamaModel.permute``; it
permutes a q/k bias the same way, and so would the writer, as it would a q/k norm's
weight); whole rows move, so codes and scales move with them unchanged. ``qwen2`` and
``qwen3`` rotate halves (``LLAMA_ROPE_TYPE_NEOX``): their rows stay as they are. Every
family's keys are prefixed by its architecture (``qwen3.attention.head_count``, ...); an
explicit ``head_dim`` (``ModelConfig.attn_head_dim``) is written as
``{arch}.attention.key_length`` and ``value_length``, as the converter does.
Every RMSNorm weight is stored as the factor the norm multiplies by: Gemma 3's
``1 + w`` (``Family.norm_offset``) is baked in, as ``Gemma3Model.modify_tensors`` adds 1 to
every ``*norm.weight`` (the reader takes it off again; llama.cpp's graphs multiply by the
stored weight). The family
itself is recorded under ``microscale.family`` (:data:`MS_FAMILY_KEY`; other readers ignore
it), so Mistral comes back as Mistral. Refused before any work (:func:`check_arch`), naming
the key and its value, is what an architecture's graph would compute otherwise than
microscale:

* a ``sliding_window`` shorter than ``max_seq_len`` (llama.cpp's llama, qwen2 and qwen3
  graphs attend to every earlier position, and the converter writes Mistral as llama);
* NVFP4 on a layer whose ``.scale`` the graph loads but never applies (``qwen2``'s and
  ``gemma3``'s MLP: ``build_ffn`` gets no scales; measured on gemma3: NaN logits);
* ``qwen2`` with ``n_heads * head_dim != d_model`` (its attn_q / attn_output are square);
* llama3 RoPE scaling (the ``rope_freqs.weight`` tensor) where only ``llama`` reads it;
* a family switch the graph does not have, or has and the family lacks (post-norms, the
  embedding's ``sqrt(d_model)``, the MLP's activation: ``gemma3`` has all three, GeGLU);
* attention scores not scaled as the graph scales them: every graph by ``head_dim ** -0.5``
  except ``gemma3`` at 62 layers (its 27B), by ``(d_model // n_heads) ** -0.5``
  (``hparams.f_attention_scale``; the converter writes no ``query_pre_attn_scalar``);
* for ``gemma3``'s local and global layers (llama.cpp: layer ``i`` local iff ``i % 6 < 5``,
  window ``gemma3.attention.sliding_window``, RoPE base 10000 unscaled; global: every
  earlier key, ``rope.freq_base`` and the scaling), any layer whose window or RoPE differs
  from that: ``sliding_window_pattern`` other than 6, ``rope_local_theta`` other than
  10000 (the converter writes neither ``sliding_window_pattern`` nor ``rope.freq_base_swa``,
  which only newer llama.cpp reads); yarn there (its factors would reach the local layers).
  No sliding window is written as one of ``max_seq_len`` (the same attention).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from microscale.export.gguf.rope import ROPE_FREQS
from microscale.formats import QArray, get_weight_format
from microscale.model import ModelConfig, linear_paths

__all__ = [
    "ARCHS",
    "MS_FAMILY_KEY",
    "OTHER_NAMES",
    "Arch",
    "check_arch",
    "check_scales",
    "gguf_layer_candidates",
    "is_norm",
    "param_tensor",
    "rope_order",
    "stored_rows",
    "tensor_name",
]

# Linear sub-path -> GGUF name inside ``blk.N`` (every architecture here: ATTN_Q, ..., FFN_UP).
_LINEAR_NAMES = {
    "attn.q_proj": "attn_q",
    "attn.k_proj": "attn_k",
    "attn.v_proj": "attn_v",
    "attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Every other block parameter a family may have: sub-path -> GGUF name inside ``blk.N``
# (gguf-py's constants.py: ATTN_NORM, FFN_NORM, ATTN_Q/K/V "bias", ATTN_Q_NORM, ATTN_K_NORM).
OTHER_NAMES = {
    "attn_norm.scale": "attn_norm.weight",
    "mlp_norm.scale": "ffn_norm.weight",
    "attn.q_proj.bias": "attn_q.bias",
    "attn.k_proj.bias": "attn_k.bias",
    "attn.v_proj.bias": "attn_v.bias",
    "attn.q_norm.scale": "attn_q_norm.weight",
    "attn.k_norm.scale": "attn_k_norm.weight",
    "attn_post_norm.scale": "post_attention_norm.weight",
    "mlp_post_norm.scale": "post_ffw_norm.weight",
}
_NON_BLOCK = {
    "embed.embedding": "token_embd.weight",
    "final_norm.scale": "output_norm.weight",
    "lm_head.kernel": "output.weight",
}
# Block parameters whose rows (first axis; kernels in HF orientation) run over q's or k's
# head dims: what an adjacent-pair RoPE permutes per head.
_ROPE_PERMUTED = (
    "attn.q_proj.kernel",
    "attn.k_proj.kernel",
    "attn.q_proj.bias",
    "attn.k_proj.bias",
    "attn.q_norm.scale",
    "attn.k_norm.scale",
)
# microscale's family, recorded beside llama.cpp's keys (Mistral's architecture is llama).
MS_FAMILY_KEY = "microscale.family"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Arch:
    """What llama.cpp's graph of one ``general.architecture`` reads (``src/models/<name>.cpp``,
    ``llama_model_rope_type`` and the generic ``.scale`` pass of ``src/llama-model.cpp``)."""

    name: str
    # The family a file of this architecture reads back as without MS_FAMILY_KEY.
    family: str
    # RoPE on adjacent pairs (LLAMA_ROPE_TYPE_NORM): the _ROPE_PERMUTED rows are permuted.
    permuted: bool
    # Linear kinds whose ``.scale`` tensor is loaded but not passed to the matmul.
    unscaled: tuple[str, ...] = ()
    # Reads rope_freqs.weight (llama3 RoPE scaling).
    rope_freqs: bool = False
    # Reads attn_q_norm / attn_k_norm.
    qk_norm: bool = False
    # attn_q and attn_output are [d_model, d_model]: n_heads * head_dim must be d_model.
    square_attn: bool = False
    # Family switches the graph hard-codes (microscale.model.family): the sub-layers'
    # output norms (post_attention_norm, post_ffw_norm), the embedding times sqrt(n_embd),
    # the MLP gate's activation (LLM_FFN_SILU / LLM_FFN_GELU, tanh-GELU).
    post_norms: bool = False
    embed_scale: bool = False
    mlp_act: str = "silu"
    # Local layers (LLAMA_SWA_TYPE_STANDARD, set_swa_pattern): layer i is local iff
    # i % swa_pattern < swa_pattern - 1, with {arch}.attention.sliding_window and the
    # unscaled RoPE base swa_theta (rope_freq_base_train_swa); 0: every layer global.
    swa_pattern: int = 0
    swa_theta: float = 10000.0
    # The n_layers at which q is scaled by (n_embd / n_head) ** -0.5, not head_dim's.
    wide_scale_layers: int | None = None
    # The converter writes attention.key_length / value_length for every model.
    head_dim_keys: bool = False


ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch(name="llama", family="llama", permuted=True, rope_freqs=True),
        Arch(
            name="qwen2",
            family="qwen2",
            permuted=False,
            unscaled=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
            square_attn=True,
        ),
        Arch(name="qwen3", family="qwen3", permuted=False, qk_norm=True),
        Arch(
            name="gemma3",
            family="gemma3",
            permuted=False,
            unscaled=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
            qk_norm=True,
            post_norms=True,
            embed_scale=True,
            mlp_act="gelu_tanh",
            swa_pattern=6,
            wide_scale_layers=62,
            head_dim_keys=True,
        ),
    )
}


def tensor_name(path: str) -> str:
    """GGUF name of a linear layer (``layers.3.mlp.up_proj`` -> ``blk.3.ffn_up``)."""
    _, i, kind = path.split(".", 2)
    return f"blk.{i}.{_LINEAR_NAMES[kind]}"


def param_tensor(path: str) -> str:
    """GGUF tensor name of a parameter (``layers.0.attn.q_proj.bias`` -> ``blk.0.attn_q.bias``,
    ``layers.0.mlp.up_proj.kernel`` -> ``blk.0.ffn_up.weight``)."""
    if path in _NON_BLOCK:
        return _NON_BLOCK[path]
    if path.endswith(".kernel"):
        return tensor_name(path[: -len(".kernel")]) + ".weight"
    _, i, sub = path.split(".", 2)
    return f"blk.{i}.{OTHER_NAMES[sub]}"


def check_arch(cfg: ModelConfig) -> Arch:
    """The llama.cpp architecture of ``cfg``'s family; what its graph would compute otherwise
    than microscale is refused, naming the key and its value (the module doc)."""
    arch = ARCHS[cfg.arch.gguf_arch]
    where = f"GGUF export: llama.cpp's {arch.name} graph"
    if arch.swa_pattern:
        _check_layers(cfg, arch, where)
    elif cfg.sliding_window is not None and cfg.sliding_window < cfg.max_seq_len:
        raise ValueError(
            f"{where} (family {cfg.family!r}) attends to every earlier position; "
            f"ModelConfig.sliding_window={cfg.sliding_window} < max_seq_len="
            f"{cfg.max_seq_len} cannot be stored (export it to an HF folder instead)"
        )
    if cfg.arch.qk_norm and not arch.qk_norm:
        raise ValueError(f"{where} has no q/k norms (family {cfg.family!r} has them)")
    for switch in ("post_norms", "embed_scale", "mlp_act"):
        if getattr(cfg.arch, switch) != getattr(arch, switch):
            raise ValueError(
                f"{where} has {switch}={getattr(arch, switch)!r}; family {cfg.family!r} "
                f"has {getattr(cfg.arch, switch)!r}"
            )
    dim = cfg.d_model // cfg.n_heads if cfg.n_layers == arch.wide_scale_layers else cfg.head_dim
    if cfg.attn_scale != float(dim) ** -0.5:
        raise ValueError(
            f"{where} scales attention scores by {dim} ** -0.5 (head_dim, or d_model // "
            f"n_heads at {arch.wide_scale_layers} layers); ModelConfig.query_pre_attn_scalar="
            f"{cfg.query_pre_attn_scalar or cfg.head_dim} cannot be stored (export it to an HF "
            "folder instead)"
        )
    if arch.square_attn and cfg.n_heads * cfg.head_dim != cfg.d_model:
        raise ValueError(
            f"{where} needs n_heads * head_dim == d_model (its attn_q and attn_output are "
            f"[d_model, d_model]); ModelConfig.attn_head_dim={cfg.attn_head_dim} gives "
            f"{cfg.n_heads} * {cfg.head_dim} != {cfg.d_model}"
        )
    sc = cfg.rope_scaling
    if sc is not None and sc.kind == "llama3" and not arch.rope_freqs:
        raise ValueError(
            f"{where} does not read {ROPE_FREQS}, which holds llama3's RoPE; "
            f"rope_scaling.kind='llama3' cannot be stored for family {cfg.family!r}"
        )
    if sc is not None and sc.kind == "yarn" and arch.swa_pattern:
        raise ValueError(
            f"{where} passes yarn's extrapolation and attention factors to its local layers "
            "too, which microscale rotates unscaled; rope_scaling.kind='yarn' cannot be "
            f"stored for family {cfg.family!r} (export it to an HF folder instead)"
        )
    return arch


def _llama_cpp_layers(cfg: ModelConfig, arch: Arch) -> list[tuple[int | None, float, Any]]:
    """Per layer, (window, RoPE base, scaling) as ``arch``'s graph runs a file of ``cfg``
    (window None: every earlier key; a window of max_seq_len or more is none)."""
    window = _window(cfg)
    out: list[tuple[int | None, float, Any]] = []
    for i in range(cfg.n_layers):
        local = bool(arch.swa_pattern) and i % arch.swa_pattern < arch.swa_pattern - 1
        if local:
            out.append((window, arch.swa_theta, None))
        else:
            out.append((None, float(cfg.rope_theta), cfg.rope_scaling))
    return out


def _window(cfg: ModelConfig, i: int | None = None) -> int | None:
    """``cfg``'s sliding window (of layer ``i``), None where it covers the context."""
    w = cfg.sliding_window if i is None else cfg.layer_window(i)
    return None if w is None or w >= cfg.max_seq_len else w


def _check_layers(cfg: ModelConfig, arch: Arch, where: str) -> None:
    """Refuses a layer whose window or RoPE ``arch``'s local/global pattern would change."""
    for i, want in enumerate(_llama_cpp_layers(cfg, arch)):
        theta, scaling = cfg.layer_rope(i)
        got = (_window(cfg, i), float(theta), scaling)
        if got != want:
            kind = "local" if i % arch.swa_pattern < arch.swa_pattern - 1 else "global"
            raise ValueError(
                f"{where} runs layer {i} as {kind} (window {want[0]}, RoPE base {want[1]}, "
                f"scaling {want[2]}: layer i local iff i % {arch.swa_pattern} < "
                f"{arch.swa_pattern - 1}, local base {arch.swa_theta}); ModelConfig gives it "
                f"window {got[0]}, base {got[1]}, scaling {got[2]} (sliding_window_pattern="
                f"{cfg.sliding_window_pattern}, rope_local_theta={cfg.rope_local_theta}, "
                f"sliding_window={cfg.sliding_window}): cannot be stored (export it to an HF "
                "folder instead)"
            )


def gguf_layer_candidates(cfg: ModelConfig, formats: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """{linear path: the ``formats`` it may take in a GGUF of ``cfg``} for the layers the
    file restricts: no global-scale format (NVFP4) where llama.cpp's graph does not apply
    the ``.scale`` tensor (qwen2's and gemma3's MLP; `check_scales`). A model the file
    cannot store at all is refused here, naming why (`check_arch`), before any work."""
    arch = check_arch(cfg)
    kept = tuple(f for f in formats if not get_weight_format(f).has_global_scale)
    return {
        p: kept
        for p in linear_paths(cfg)
        if p.split(".", 2)[2] in arch.unscaled and len(kept) < len(formats)
    }


def check_scales(arch: Arch, formats: Mapping[str, str]) -> None:
    """Refuses a global-scale format (NVFP4) on a layer whose ``.scale`` tensor ``arch``'s
    graph does not apply (it would run with the weights off by that factor)."""
    for p, f in formats.items():
        if get_weight_format(f).has_global_scale and p.split(".", 2)[2] in arch.unscaled:
            raise ValueError(
                f"GGUF export: {p} in {f}: llama.cpp's {arch.name} graph does not apply "
                f"{tensor_name(p)}.scale, the FP32 tensor scale {f} needs (use mxfp4, q8_0 "
                f"or bf16 for {', '.join(arch.unscaled)})"
            )


def stored_rows(arch: Arch, path: str, n_rows: int, head_dim: int) -> np.ndarray | None:
    """The order ``arch`` stores the rows of parameter ``path`` in (None: as they are)."""
    block = path.split(".", 2)[2] if path.startswith("layers.") else None
    return _rope_rows(n_rows, head_dim) if arch.permuted and block in _ROPE_PERMUTED else None


def rope_order(arch: Arch, path: str, x: Any, head_dim: int) -> Any:
    """``x``, parameter ``path`` (a kernel in HF orientation), in ``arch``'s row order."""
    rows = stored_rows(arch, path, x.shape[0], head_dim)
    return x if rows is None else _permute_rows(x, rows)


def _rope_rows(n_rows: int, head_dim: int) -> np.ndarray:
    """Row order that turns rotate-half RoPE pairs (i, i + hd/2) into adjacent pairs."""
    half = head_dim // 2
    per_head = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    return (np.arange(n_rows // head_dim)[:, None] * head_dim + per_head).reshape(-1)


def _permute_rows(w: Any, rows: np.ndarray) -> Any:
    if not isinstance(w, QArray):
        return np.asarray(w)[rows]
    scales = None if w.scales is None else np.asarray(w.scales)[rows]  # ggml's: in the rows
    return dataclasses.replace(w, data=np.asarray(w.data)[rows], scales=scales)


def is_norm(path: str) -> bool:
    """Whether parameter ``path`` is an RMSNorm weight (``...norm.scale``)."""
    return path.endswith("norm.scale")
