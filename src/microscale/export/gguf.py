"""GGUF export: one file that llama.cpp (ggml's CPU, Metal, CUDA... backends) loads and runs.

Written with the ``gguf`` package's ``GGUFWriter`` (the container is never hand-made). Each
linear layer keeps the format microscale quantized it in whenever ggml has a native type:

=========  =====================  ==================================================
microscale ggml type              block layout (ggml/src/ggml-common.h)
=========  =====================  ==================================================
nvfp4      ``NVFP4 = 40``         36 bytes per 64 values: 4 unsigned-E4M3 scale bytes
                                  (one per 16), then 32 code bytes; in each 16-group
                                  byte j = element j (low nibble) | element j+8 (high).
                                  The FP32 tensor scale ``s_dec`` is a separate
                                  ``<name>.scale`` F32 ``[1]`` tensor that llama.cpp
                                  multiplies onto the matmul output.
mxfp4      ``MXFP4 = 39``         17 bytes per 32 values: the E8M0 byte, then 16 bytes;
                                  byte j = element j (low) | element j+16 (high).
q8_0       ``Q8_0 = 8``           34 bytes per 32 values: float16 scale, 32 int8.
8-bit      ``Q8_0``               FP8 / MXFP8 layers have no ggml type: requantized to
                                  Q8_0 from the float weights (the master weights of a
                                  run, the decoded 8-bit weights of a packed folder).
bf16       ``BF16`` (or F16/F32)  unquantized layers, embeddings, LM head.
=========  =====================  ==================================================

ggml's own integer types (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K ... Q6_K, IQ4_NL, IQ4_XS:
``formats.spec.GGML_FORMATS``) are written from float weights by :func:`gguf_ggml_tensor`,
bit for bit as ggml's quantizer writes them (``formats/ggml.py``); ``write_gguf``'s layer
formats do not take them yet (its layer table is the JAX formats').

Norm weights, biases and ``.scale`` tensors are F32. ggml decodes E2M1 codes as doubled
integers (``kvalues = 2 * e2m1``) times half the block scale; both products are exact in
float32, so decoding a file gives microscale's ``dequantize`` bit for bit (tested with the
``gguf`` package's own dequantizers). The byte of an E4M3 scale *is* its UE4M3 byte: block
scales are never negative, and 0x7F (NaN in E4M3, 0 in UE4M3) never occurs for finite
weights. Element packing reuses :func:`microscale.formats.pack_nibbles` on codes reordered
so that each pair (j, j + half a scale block) lands in one byte.

A row of ``K`` inputs holds ``K / 64`` NVFP4 blocks (``K / 32`` MXFP4 / Q8_0 blocks): other
lengths cannot be stored and are refused, naming the tensor, as are non-finite weights.

Families (:mod:`microscale.model.family`) go out as llama.cpp's converter
(``convert_hf_to_gguf.py``) writes their HF checkpoints; ``_ARCHS`` holds what each
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
permutes a q/k bias the same way, and so would this writer, as it would a q/k norm's
weight); whole rows move, so codes and scales move with them unchanged. ``qwen2`` and
``qwen3`` rotate halves (``LLAMA_ROPE_TYPE_NEOX``): their rows stay as they are. Every
family's keys are prefixed by its architecture (``qwen3.attention.head_count``, ...); an
explicit ``head_dim`` (``ModelConfig.attn_head_dim``) is written as
``{arch}.attention.key_length`` and ``value_length``, as the converter does. The family
Every RMSNorm weight is stored as the factor the norm multiplies by: Gemma 3's
``1 + w`` (``Family.norm_offset``) is baked in, as ``Gemma3Model.modify_tensors`` adds 1 to
every ``*norm.weight`` (the reader takes it off again; llama.cpp's graphs multiply by the
stored weight). The family
itself is recorded under ``microscale.family`` (other readers ignore it), so Mistral comes
back as Mistral. Refused before any work, naming the key and its value, is what an
architecture's graph would compute otherwise than microscale:

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

RoPE scaling: the keys and the ``rope_freqs.weight`` tensor that llama.cpp's converter writes
for the model's ``config.json`` (linear, yarn, llama3); dynamic NTK, and yarn settings
llama.cpp does not compute, are refused by name before any work
(:mod:`microscale.export.gguf_rope`).

Tokenizer: byte-level BPE in ggml's ``gpt2`` vocabulary (token text = GPT-2's
byte-to-unicode characters). microscale's byte tokenizer has no merges; llama.cpp's
``gpt2`` vocabulary needs a merge list, so it gets one merge of two multi-character
symbols that no merge creates, which therefore never fires, and every byte stays its
own token (id = byte value, ``<|eos|>`` = 256). A trained or imported BPE keeps its vocab
and merges; its pre-tokenizer must be one llama.cpp implements (GPT-2's ByteLevel regex ->
``gpt-2``, digits split then GPT-2's regex -> ``smollm``, Llama 3's split regex ->
``llama-bpe``, Qwen2's -> ``qwen2``, with its NFC normalizer, which llama.cpp does not
apply: text in NFC tokenizes the same, other text may not); anything else is refused, naming it, before any weight is read. Given a
``tokenizer.json`` path, the ``tokenizer_config.json`` beside it supplies the bos / eos /
pad ids, ``add_bos_token`` and the chat template (:func:`gguf_vocab`), so an Instruct
model stops at its own end-of-turn token in llama.cpp.

The file is written to a temporary sibling and renamed when complete
(:func:`microscale.files.atomic_writer`): a killed export leaves no file that loads.

Integrity: the metadata carries ``microscale.crc32.tensors`` (the CRC-32 of every tensor's
stored bytes, as JSON) and ``microscale.crc32.header`` (the CRC-32 of the header and tensor
table), which other readers ignore; :mod:`microscale.export.gguffile` defines them and
checks a file against them (``microscale verify``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from microscale.data import check_vocab_fits
from microscale.export import layouts as L
from microscale.export.gguf_rope import ROPE_FREQS, gguf_rope
from microscale.export.gguffile import CRC_HEADER_KEY, CRC_TENSORS_KEY, seal_gguf_header
from microscale.export.params import check_params
from microscale.export.tokenizer import byte_tokenizer_hf
from microscale.files import atomic_writer
from microscale.formats import (
    QArray,
    block_scales_f32,
    dequantize,
    get_format,
    pack_nibbles,
    quantize,
    unpack_nibbles,
)
from microscale.formats.ggml import fallback_format, quantize_ggml
from microscale.formats.spec import get_ggml_format
from microscale.integrity import crc32_many
from microscale.model import ModelConfig, block_param_shapes, linear_paths

__all__ = [
    "EMBED_FORMATS",
    "GGUF_FORMATS",
    "MS_FAMILY_KEY",
    "GGUFResult",
    "GGUFVocab",
    "embed_values",
    "gguf_embed_format",
    "gguf_format",
    "gguf_ggml_tensor",
    "gguf_layer_candidates",
    "gguf_layer_formats",
    "gguf_tensor",
    "gguf_vocab",
    "tensor_name",
    "write_gguf",
]

# microscale formats ggml runs natively -> GGMLQuantizationType member name.
GGUF_FORMATS: dict[str, str] = {"nvfp4": "NVFP4", "mxfp4": "MXFP4", "q8_0": "Q8_0"}
_FLOAT_TYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
# Stored formats of the token embedding (and of an untied LM head): unquantized (bf16) or a
# ggml type without a global (per-tensor) scale, so llama.cpp's get_rows (the embedding
# lookup) and the tied LM head matmul both decode it. NVFP4 is not one of them: its FP32
# tensor scale lives in a separate ``.scale`` tensor that llama.cpp's graphs apply to
# linear layers' outputs, not to the embedding lookup.
EMBED_FORMATS = ("bf16",) + tuple(f for f in GGUF_FORMATS if not get_format(f).has_global_scale)
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
_OTHER_NAMES = {
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
class _Arch:
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


_ARCHS: dict[str, _Arch] = {
    a.name: a
    for a in (
        _Arch(name="llama", family="llama", permuted=True, rope_freqs=True),
        _Arch(
            name="qwen2",
            family="qwen2",
            permuted=False,
            unscaled=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
            square_attn=True,
        ),
        _Arch(name="qwen3", family="qwen3", permuted=False, qk_norm=True),
        _Arch(
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
# Pre-tokenizer regexes llama.cpp implements (src/llama-vocab.cpp) -> tokenizer.ggml.pre.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's (Qwen2.5, Qwen3): Llama 3's with single digits -> "qwen2".
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLITS = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}
# The one normalizer a pre-tokenizer's tokenizers carry: Qwen2's NFC. llama.cpp applies
# none, so text already in NFC (what most text is) tokenizes the same, other text not.
_NORMALIZERS = {"qwen2": ({"type": "NFC"},)}
# A merge that never fires: no merge creates either multi-character symbol.
_NOOP_MERGE = "\u0120\u0120 \u0120\u0120"


def _gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover - the [gguf] extra
        raise ImportError(
            "GGUF export needs the gguf package: pip install "
            "'microscale[gguf]' (or pip install 'gguf>=0.19')"
        ) from None
    return gguf


def gguf_format(fmt: str) -> str:
    """The format a layer in ``fmt`` is stored in: ggml's native 4/8-bit types as is, other
    8-bit formats (FP8, MXFP8) as ``q8_0``, unquantized ones as ``bf16``."""
    spec = get_format(fmt)
    if spec.name in GGUF_FORMATS or not spec.quantized:
        return spec.name if spec.quantized else "bf16"
    if spec.elem_bits == 8:
        return "q8_0"
    raise ValueError(
        f"format {spec.name!r} has no GGUF type; expected one of "
        f"{sorted(GGUF_FORMATS)}, an 8-bit format (stored as q8_0) or bf16"
    )


def gguf_embed_format(fmt: str) -> str:
    """The stored format of the token embedding / LM head for ``fmt`` (one of
    :data:`EMBED_FORMATS`, or an 8-bit format, stored as ``q8_0``); others are refused."""
    stored = gguf_format(fmt)
    if stored not in EMBED_FORMATS:
        raise ValueError(
            f"embed_format={fmt!r}: the token embedding / LM head can be stored "
            f"as {list(EMBED_FORMATS)} (or an 8-bit format, as q8_0); {stored} "
            "needs a tensor scale that llama.cpp does not apply to the "
            "embedding lookup"
        )
    return stored


def _embed_qarray(x: Any, fmt: str) -> QArray:
    """A ``[vocab, d_model]`` table quantized as a GGUF stores it in the quantized ``fmt``:
    along ``d_model`` (one block row per token), from float32."""
    return quantize(jnp.asarray(x, jnp.float32), gguf_embed_format(fmt), axis=1)


def embed_values(x: Any, fmt: str) -> jax.Array:
    """The float32 ``[vocab, d_model]`` values llama.cpp decodes from the table ``x``
    stored in the quantized ``fmt`` (:func:`write_gguf`'s ``embed_format``): what the
    search scores a token embedding / LM head format with (``microscale.ptq``); bf16: the
    table rounded to bfloat16."""
    if gguf_embed_format(fmt) == "bf16":
        return jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)
    return dequantize(_embed_qarray(x, fmt))


def _embed_tensor(x: Any, fmt: str, name: str, dtype: str) -> tuple[np.ndarray, Any]:
    """A ``[vocab, d_model]`` embedding (or transposed LM head kernel) as stored: ``dtype``
    when ``fmt`` is bf16, else quantized along ``d_model`` (one block row per token)."""
    if fmt == "bf16":
        return _float_tensor(x, dtype)
    return gguf_tensor(_embed_qarray(x, fmt), name)


def tensor_name(path: str) -> str:
    """GGUF name of a linear layer (``layers.3.mlp.up_proj`` -> ``blk.3.ffn_up``)."""
    _, i, kind = path.split(".", 2)
    return f"blk.{i}.{_LINEAR_NAMES[kind]}"


def _param_tensor(path: str) -> str:
    """GGUF tensor name of a parameter (``layers.0.attn.q_proj.bias`` -> ``blk.0.attn_q.bias``,
    ``layers.0.mlp.up_proj.kernel`` -> ``blk.0.ffn_up.weight``)."""
    if path in _NON_BLOCK:
        return _NON_BLOCK[path]
    if path.endswith(".kernel"):
        return tensor_name(path[: -len(".kernel")]) + ".weight"
    _, i, sub = path.split(".", 2)
    return f"blk.{i}.{_OTHER_NAMES[sub]}"


def _arch(cfg: ModelConfig) -> _Arch:
    """The llama.cpp architecture of ``cfg``'s family; what its graph would compute otherwise
    than microscale is refused, naming the key and its value (the module doc)."""
    arch = _ARCHS[cfg.arch.gguf_arch]
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


def _llama_cpp_layers(cfg: ModelConfig, arch: _Arch) -> list[tuple[int | None, float, Any]]:
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


def _check_layers(cfg: ModelConfig, arch: _Arch, where: str) -> None:
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
    the ``.scale`` tensor (qwen2's and gemma3's MLP; `_check_scales`). A model the file
    cannot store at all is refused here, naming why (`_arch`), before any work."""
    arch = _arch(cfg)
    kept = tuple(f for f in formats if not get_format(f).has_global_scale)
    return {
        p: kept
        for p in linear_paths(cfg)
        if p.split(".", 2)[2] in arch.unscaled and len(kept) < len(formats)
    }


def _check_scales(arch: _Arch, formats: Mapping[str, str]) -> None:
    """Refuses a global-scale format (NVFP4) on a layer whose ``.scale`` tensor ``arch``'s
    graph does not apply (it would run with the weights off by that factor)."""
    for p, f in formats.items():
        if get_format(f).has_global_scale and p.split(".", 2)[2] in arch.unscaled:
            raise ValueError(
                f"GGUF export: {p} in {f}: llama.cpp's {arch.name} graph does not apply "
                f"{tensor_name(p)}.scale, the FP32 tensor scale {f} needs (use mxfp4, q8_0 "
                f"or bf16 for {', '.join(arch.unscaled)})"
            )


def _stored_rows(arch: _Arch, path: str, n_rows: int, head_dim: int) -> np.ndarray | None:
    """The order ``arch`` stores the rows of parameter ``path`` in (None: as they are)."""
    block = path.split(".", 2)[2] if path.startswith("layers.") else None
    return _rope_rows(n_rows, head_dim) if arch.permuted and block in _ROPE_PERMUTED else None


def _rope_order(arch: _Arch, path: str, x: Any, head_dim: int) -> Any:
    """``x``, parameter ``path`` (a kernel in HF orientation), in ``arch``'s row order."""
    rows = _stored_rows(arch, path, x.shape[0], head_dim)
    return x if rows is None else _permute_rows(x, rows)


def _rope_rows(n_rows: int, head_dim: int) -> np.ndarray:
    """Row order that turns rotate-half RoPE pairs (i, i + hd/2) into adjacent pairs."""
    half = head_dim // 2
    per_head = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    return (np.arange(n_rows // head_dim)[:, None] * head_dim + per_head).reshape(-1)


def _permute_rows(w: Any, rows: np.ndarray) -> Any:
    if not isinstance(w, QArray):
        return np.asarray(w)[rows]
    return dataclasses.replace(w, data=np.asarray(w.data)[rows], scales=np.asarray(w.scales)[rows])


def gguf_tensor(q: QArray, name: str) -> tuple[np.ndarray, Any]:
    """(uint8 ``[N, bytes per row]``, GGMLQuantizationType) of a weight QArray in HF
    orientation ``[N, K]`` (blocks along ``K``), in ggml's block layout (module doc)."""
    gguf = _gguf()
    spec = q.spec
    if spec.name not in GGUF_FORMATS:
        raise ValueError(
            f"{name}: format {spec.name!r} has no GGUF block type; expected one "
            f"of {sorted(GGUF_FORMATS)}"
        )
    qtype = gguf.GGMLQuantizationType[GGUF_FORMATS[spec.name]]
    per_block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    q = L.row_blocks(L.to_hf_orientation(q))
    n, k = q.shape
    if k % per_block:
        raise ValueError(
            f"{name}: input dimension {k} is not a multiple of {per_block}, "
            f"the {qtype.name} block length; ggml cannot hold this tensor "
            f"(use another format for this layer, e.g. bf16)"
        )
    sub = spec.block_size
    assert sub is not None  # only block-scaled formats have a ggml block type
    groups = per_block // sub  # scale groups per ggml block
    scales = np.asarray(q.scales)[:n]  # 16x16 tiles may pad rows
    data = np.asarray(q.data)[:n]
    if spec.has_global_scale and not np.isfinite(np.asarray(q.global_scale)):
        raise ValueError(
            f"{name}: the tensor scale is {float(np.asarray(q.global_scale))} (non-finite "
            "weights); refusing to write a tensor llama.cpp would misread"
        )
    # Block scales must be finite and non-negative (decoded: E8M0 0xFF is NaN, which ggml
    # does not handle; a UE4M3 byte has no sign bit and reads 0x7F as 0).
    decoded = np.asarray(block_scales_f32(dataclasses.replace(q, scales=jnp.asarray(scales))))
    if not (np.isfinite(decoded) & (decoded >= 0) & ~np.signbit(decoded)).all():
        raise ValueError(
            f"{name}: non-finite or negative block scales (non-finite "
            "weights); refusing to write a tensor llama.cpp would misread"
        )
    sbytes = scales.view(np.uint8).reshape(n, k // per_block, -1)
    if spec.packed:
        codes = np.asarray(unpack_nibbles(jnp.asarray(data), 1)).reshape(n, -1, 2, sub // 2)
        # (j, j + sub/2) side by side, then two codes per byte: element 2i low, 2i+1 high
        pairs = np.swapaxes(codes, -1, -2).reshape(n, -1, sub)
        elems = np.asarray(pack_nibbles(jnp.asarray(pairs), -1))
    else:
        elems = data.view(np.uint8)
    elems = elems.reshape(n, k // per_block, -1)
    blocks = np.concatenate([sbytes, elems], axis=-1)
    assert blocks.shape[-1] == type_size and sbytes.shape[-1] == groups * scales.itemsize
    return np.ascontiguousarray(blocks.reshape(n, -1)), qtype


def gguf_ggml_tensor(w: Any, fmt: str, name: str, imatrix: Any = None) -> tuple[np.ndarray, Any]:
    """(uint8 ``[N, bytes per row]``, GGMLQuantizationType) of a float weight ``[N, K]`` (HF
    orientation, blocks along ``K``) in one of ggml's own block types (``GGML_FORMATS``:
    Q4_0 ... Q6_K, IQ4_NL, IQ4_XS), encoded as ggml's ``ggml_quantize_chunk`` encodes it
    (``formats/ggml.py``), with ``imatrix`` (one importance weight per input, llama.cpp's
    imatrix) where ggml uses one. A ``K`` the type's blocks do not divide is refused, naming
    the type llama.cpp would write instead."""
    gguf = _gguf()
    spec = get_ggml_format(fmt)
    x = np.asarray(jnp.asarray(w, jnp.float32))
    if x.ndim != 2:
        raise ValueError(f"{name}: expected a [N, K] weight, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: non-finite weights; refusing to write them")
    k = x.shape[1]
    fallback = fallback_format(spec, k)
    if fallback != spec.name:
        raise ValueError(
            f"{name}: input dimension {k} is not a multiple of "
            f"{spec.super_block or spec.block_size}, the {spec.name} block length; "
            f"llama.cpp writes such a tensor as {fallback}"
        )
    qtype = gguf.GGMLQuantizationType(spec.ggml_type)
    return np.ascontiguousarray(quantize_ggml(x, spec, imatrix)), qtype


def _float_tensor(x, dtype: str) -> tuple[np.ndarray, Any]:
    gguf = _gguf()
    a = np.asarray(jnp.asarray(x, jnp.float32))
    if dtype == "bfloat16":
        b = a.astype(ml_dtypes.bfloat16).view(np.uint8)
        return np.ascontiguousarray(b.reshape(*a.shape[:-1], -1)), gguf.GGMLQuantizationType.BF16
    return np.ascontiguousarray(a.astype(np.float16 if dtype == "float16" else np.float32)), None


# ---------------------------------------------------------------------- tokenizer


def _tokenizer_json(tokenizer) -> tuple[dict, int, Path | None]:
    """``(tokenizer.json as a dict, its end-of-document id, its file or None)``."""
    from microscale.data import BPETokenizer, ByteTokenizer, load_tokenizer

    file = None
    if isinstance(tokenizer, (str, os.PathLike)):
        file = Path(tokenizer)
        tokenizer = load_tokenizer(file)
    if isinstance(tokenizer, ByteTokenizer):
        return json.loads(byte_tokenizer_hf().to_str()), tokenizer.eos_id, file
    if isinstance(tokenizer, BPETokenizer):
        return json.loads(tokenizer.hf.to_str()), tokenizer.eos_id, file
    raise TypeError(
        f"tokenizer {tokenizer!r}: expected a microscale ByteTokenizer / "
        "BPETokenizer or a tokenizer file path"
    )


def _is_bytelevel(p: Any, regex: bool) -> bool:
    return (
        isinstance(p, dict)
        and p.get("type") == "ByteLevel"
        and bool(p.get("use_regex", True)) == regex
        and not p.get("add_prefix_space", False)
    )


def _pre_tokenizer(pre: Any, has_merges: bool) -> str:
    """tokenizer.ggml.pre for an HF byte-level pre-tokenizer (refuses unknown ones):
    GPT-2's ByteLevel regex -> ``gpt-2``; each digit split off, then GPT-2's regex
    (SmolLM) -> ``smollm``; Llama 3's split regex, then ByteLevel -> ``llama-bpe``; Qwen2's
    (Llama 3's with single digits) -> ``qwen2``."""
    if not has_merges and (_is_bytelevel(pre, False) or _is_bytelevel(pre, True)):
        return "default"  # every byte is its own token: how text is split cannot matter
    if _is_bytelevel(pre, True):
        return "gpt-2"
    seq = (
        (pre.get("pretokenizers") or [])
        if isinstance(pre, dict) and pre.get("type") == "Sequence"
        else []
    )
    if len(seq) == 2 and isinstance(seq[0], dict):
        first = seq[0]
        if (
            first.get("type") == "Digits"
            and first.get("individual_digits") is True
            and _is_bytelevel(seq[1], True)
        ):
            return "smollm"
        regex = (first.get("pattern") or {}).get("Regex")
        if (
            first.get("type") == "Split"
            and _is_bytelevel(seq[1], False)
            and regex in _SPLITS
            and first.get("behavior", "Isolated") == "Isolated"
            and not first.get("invert", False)
        ):
            return _SPLITS[regex]
    raise ValueError(
        f"tokenizer pre-tokenizer {json.dumps(pre)[:300]} is not one llama.cpp "
        "implements the same way; GGUF export knows GPT-2's ByteLevel regex "
        "(gpt-2), digits split then GPT-2's regex (smollm), Llama 3's split "
        "regex (llama-bpe) and Qwen2's (qwen2)"
    )


def _token_text(v: Any, key: str, where: Path | None) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken object."""
    if v is None:
        return None
    if isinstance(v, dict):
        v = v.get("content")
    if not isinstance(v, str):
        raise ValueError(f"{where}: {key}={v!r}: expected a token string")
    return v


def _chat_template(cfg: dict, folder: Path, where: Path | None) -> str | None:
    """The default chat template: tokenizer_config.json's ``chat_template`` (a string, or
    a list of named templates: "default"), else ``chat_template.jinja`` beside it."""
    t = cfg.get("chat_template")
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default")
    if t is not None and not isinstance(t, str):
        raise ValueError(
            f"{where}: chat_template: expected a string or a list of "
            "{name, template} with a 'default'"
        )
    if t is None and (folder / "chat_template.jinja").is_file():
        t = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return t


def _template_start(proc: Any) -> str | None:
    """The special token a ``TemplateProcessing`` post-processor (alone or in a
    ``Sequence``) puts before a single sequence (Llama 3's ``<|begin_of_text|>``), or None."""
    if not isinstance(proc, dict):
        return None
    if proc.get("type") == "Sequence":
        return next((t for p in proc.get("processors") or [] if (t := _template_start(p))), None)
    single = proc.get("single") if proc.get("type") == "TemplateProcessing" else None
    if not single or not isinstance(single[0], dict):
        return None
    return (single[0].get("SpecialToken") or {}).get("id")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GGUFVocab:
    """A tokenizer as llama.cpp's ``gpt2`` vocabulary (see :func:`gguf_vocab`)."""

    # {token text: id} of the model vocabulary and the added tokens.
    vocab: dict[str, int]
    # {id: special (control) or not (user-defined)} of the added tokens.
    added: dict[int, bool]
    # BPE merges ("a b"), in rank order.
    merges: list[str]
    # tokenizer.ggml.pre.
    pre: str
    # Special token ids: bos (eos when the tokenizer names none), eos, pad (or None).
    bos_id: int
    eos_id: int
    pad_id: int | None
    # Whether llama.cpp prepends bos when it tokenizes a prompt.
    add_bos: bool
    # tokenizer.chat_template, or None.
    chat_template: str | None

    @property
    def n_ids(self) -> int:
        return max(self.vocab.values()) + 1


def gguf_vocab(tokenizer: Any) -> GGUFVocab:
    """What a GGUF file stores of ``tokenizer`` (a microscale tokenizer or a
    ``tokenizer.json`` path), checked before any weight is touched: byte-level BPE with a
    pre-tokenizer llama.cpp implements (others are refused, naming it). With a path, the
    special tokens (``bos_token``, ``eos_token``, ``pad_token``), ``add_bos_token`` and
    ``chat_template`` come from ``tokenizer_config.json`` beside it (and
    ``chat_template.jinja``) when present; ``add_bos_token`` absent, bos is added when the
    tokenizer's post-processor template starts with it."""
    tj, eos, file = _tokenizer_json(tokenizer)
    model = tj.get("model") or {}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    pre = _pre_tokenizer(tj.get("pre_tokenizer"), bool(merges))
    norm = tj.get("normalizer")
    if (
        model.get("type") != "BPE"
        or model.get("byte_fallback")
        or (norm and norm not in _NORMALIZERS.get(pre, ()))
    ):
        raise ValueError(
            "tokenizer: GGUF export supports byte-level BPE tokenizers (model "
            f"type {model.get('type')!r}, byte_fallback "
            f"{model.get('byte_fallback')!r}, normalizer "
            f"{(norm or {}).get('type')!r}); expected BPE, no "
            "byte fallback, no normalizer (NFC with Qwen2's pre-tokenizer)"
        )
    if (tj.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError(
            f"tokenizer decoder {(tj.get('decoder') or {}).get('type')!r}: expected ByteLevel"
        )
    vocab = dict(model.get("vocab") or {})
    added = {}
    for t in tj.get("added_tokens") or []:
        vocab[t["content"]] = int(t["id"])
        added[int(t["id"])] = bool(t.get("special"))
    cfg: dict = {}
    folder = where = None
    if file is not None:
        folder, where = file.parent, file.parent / "tokenizer_config.json"
        if where.is_file():
            from microscale.files import read_json

            cfg = read_json(where, what="tokenizer config")
            if not isinstance(cfg, dict):
                raise ValueError(f"{where}: expected a JSON object")

    def token_id(key: str) -> int | None:
        text = _token_text(cfg.get(key), key, where)
        if text is None:
            return None
        if text not in vocab:
            raise ValueError(f"{where}: {key}={text!r} is not a token of {file}")
        return vocab[text]

    eos_id = token_id("eos_token")
    eos_id = eos if eos_id is None else eos_id
    bos_id = token_id("bos_token")
    add_bos = cfg.get("add_bos_token")
    if not isinstance(add_bos, bool):
        first = _template_start(tj.get("post_processor"))
        add_bos = first in vocab and (bos_id is None or vocab[first] == bos_id)
        if add_bos and bos_id is None:
            bos_id = vocab[first]
    return GGUFVocab(
        vocab=vocab,
        added=added,
        merges=merges,
        pre=pre,
        bos_id=eos_id if bos_id is None else bos_id,
        eos_id=eos_id,
        pad_id=token_id("pad_token"),
        add_bos=add_bos,
        chat_template=_chat_template(cfg, folder, where) if folder else None,
    )


def _add_tokenizer(w, voc: GGUFVocab, vocab_size: int) -> dict[str, Any]:
    gguf = _gguf()
    check_vocab_fits(voc.n_ids, vocab_size)
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for text, i in voc.vocab.items():
        tokens[i] = text
        types[i] = (
            gguf.TokenType.NORMAL
            if i not in voc.added
            else (gguf.TokenType.CONTROL if voc.added[i] else gguf.TokenType.USER_DEFINED)
        )
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(voc.pre)
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    w.add_token_merges(voc.merges or [_NOOP_MERGE])
    w.add_eos_token_id(voc.eos_id)
    # always written: llama.cpp's gpt2 default bos (11) would be wrong
    w.add_bos_token_id(voc.bos_id)
    if voc.pad_id is not None:
        w.add_pad_token_id(voc.pad_id)
    w.add_add_bos_token(voc.add_bos)
    w.add_add_eos_token(False)
    if voc.chat_template is not None:
        w.add_chat_template(voc.chat_template)
    return {
        "model": "gpt2",
        "pre": voc.pre,
        "tokens": voc.n_ids,
        "merges": len(voc.merges),
        "bos_id": voc.bos_id,
        "eos_id": voc.eos_id,
        "pad_id": voc.pad_id,
        "add_bos": voc.add_bos,
        "chat_template": voc.chat_template is not None,
    }


# ---------------------------------------------------------------------- export


@dataclasses.dataclass(frozen=True, kw_only=True)
class GGUFResult:
    """What :func:`write_gguf` wrote."""

    # The file.
    path: Path
    # {linear path: stored format (nvfp4, mxfp4, q8_0, bf16)}.
    layers: dict[str, str]
    # Bytes of tensor data.
    tensor_bytes: int
    # Tokenizer entry written (model, pre, tokens, merges).
    tokenizer: dict[str, Any]
    # The model config written.
    config: ModelConfig
    # The layout (the name of its registry row).
    layout: str = "gguf"
    # Stored format of the token embedding (and of an untied LM head): bf16 = ``dtype``.
    embedding: str = "bf16"

    def describe(self) -> dict[str, Any]:
        """What a report records of the export (``quantize``'s ``checkpoint`` entry)."""
        return {
            "layout": self.layout,
            "path": str(self.path),
            "files": [self.path.name],
            "tokenizer": self.tokenizer,
            "embedding": self.embedding,
        }


def gguf_layer_formats(
    cfg: ModelConfig, params: Mapping[str, Any], layer_formats: L.LayerFormats, ck_layers=None
) -> dict[str, str]:
    """{linear path: stored format}: the requested formats (default: a Checkpoint's own
    layers, else NVFP4) mapped through :func:`gguf_format`."""
    if layer_formats is None and ck_layers is not None:
        layer_formats = {p: lq.weights for p, lq in ck_layers.items()}
    layers = L.resolve_layers(cfg, layer_formats)
    return {p: gguf_format(lq.weights) for p, lq in layers.items()}


def write_gguf(
    model: Any,
    path: str | os.PathLike,
    *,
    config: ModelConfig | None = None,
    layer_formats: L.LayerFormats = None,
    tokenizer: Any = None,
    dtype: str = "bfloat16",
    embed_format: str = "bf16",
    name: str | None = None,
    overwrite: bool = False,
) -> GGUFResult:
    """Write ``model`` as a llama.cpp GGUF file of its family's architecture (see the
    module doc: what each family gets, and what is refused before any work).

    Args:
      model: a ``Transformer``, its params (kernels may be pre-quantized QArrays, e.g. from
        PTQ: stored byte for byte when their format is native to ggml), or a
        ``Checkpoint`` from :func:`~microscale.export.read_checkpoint` (its layers' formats).
      path: the ``.gguf`` file.
      config: the ``ModelConfig`` (taken from a Transformer / Checkpoint when omitted).
      layer_formats: per-layer formats as :func:`~microscale.export.resolve_layers` takes
        them (default NVFP4; a qwen2 MLP needs another: llama.cpp's qwen2 graph drops
        NVFP4's tensor scale there); FP8 / MXFP8 become Q8_0, unquantized ones ``dtype``.
      tokenizer: a microscale tokenizer or a ``tokenizer.json`` path (required: llama.cpp
        needs a vocab); a path brings the special tokens and chat template of the
        ``tokenizer_config.json`` beside it (:func:`gguf_vocab`).
      dtype: unquantized tensors: "bfloat16" (default), "float16" or "float32".
      embed_format: the token embedding (the tied LM head) and an untied LM head: "bf16"
        (default: stored as ``dtype``), "q8_0" or "mxfp4" (8-bit formats become q8_0):
        about a half or a quarter of the BF16 bytes a decode step reads for the LM head.
      name: ``general.name`` (default: the file's stem).
      overwrite: replace an existing file.
    """
    from microscale.export.writer import _source

    _gguf()  # without the gguf package: refused before any work
    if dtype not in _FLOAT_TYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(_FLOAT_TYPES)}")
    out = Path(path)
    if out.is_dir():
        raise IsADirectoryError(
            f"--out {str(out)!r} is a folder; GGUF export writes one file (e.g. model.gguf)"
        )
    if out.exists() and not overwrite:
        raise FileExistsError(f"{str(out)!r} exists; pass overwrite=True (CLI: overwrite=true)")
    if tokenizer is None:
        raise ValueError(
            "GGUF export needs the model's tokenizer (llama.cpp stores the vocab "
            "in the file); pass tokenizer=... (a run or a folder with "
            "tokenizer.json provides it)"
        )
    emb_fmt = gguf_embed_format(embed_format)
    vocab = gguf_vocab(tokenizer)  # an unsupported tokenizer is refused before any work
    params, cfg, ck_layers, _ = _source(model, config)
    arch = _arch(cfg)  # what the family's llama.cpp graph cannot compute: refused first
    gguf_rope(cfg)  # a RoPE scaling llama.cpp cannot compute: refused before any work
    check_params(params, cfg)
    formats = gguf_layer_formats(cfg, params, layer_formats, ck_layers)
    _check_scales(arch, formats)
    _check_finite(params)
    # Every tensor is built and validated before the file is touched.
    tensors = _tensors(params, cfg, arch, formats, emb_fmt, dtype)
    tok = _write_file(out, name or out.stem, cfg, vocab, tensors)
    return GGUFResult(
        path=out,
        layers=formats,
        tensor_bytes=sum(a.nbytes for _, a, _ in tensors),
        tokenizer=tok,
        config=cfg,
        embedding=emb_fmt,
    )


def _check_finite(params: Mapping[str, Any]) -> None:
    """ValueError naming the first tensor with a NaN or Inf (checked before quantizing:
    formats' amax may not see a NaN)."""
    for key, v in params.items():
        a = dequantize(v) if isinstance(v, QArray) else jnp.asarray(v, jnp.float32)
        if not np.isfinite(np.asarray(a)).all():
            raise ValueError(
                f"{_param_tensor(key)}: non-finite weights (NaN or Inf); refusing to write a "
                "file llama.cpp would misread"
            )


_Tensor = tuple[str, np.ndarray, Any]  # (GGUF name, stored array, raw ggml type or None)


def _tensors(
    params: Mapping[str, Any],
    cfg: ModelConfig,
    arch: _Arch,
    formats: Mapping[str, str],
    emb_fmt: str,
    dtype: str,
) -> list[_Tensor]:
    """Every tensor of the file in order, as stored: the token embedding in ``emb_fmt``,
    the norms (and the family's biases, q/k norms), the linear layers in ``formats`` (with
    their ``.scale``), an untied LM head; q/k rows in ``arch``'s order."""
    # Kernels that are not already in their stored format are decoded (8-bit -> Q8_0).
    params = dict(params)
    for p, f in formats.items():
        v = params[f"{p}.kernel"]
        if isinstance(v, QArray) and v.spec.name != f:
            params[f"{p}.kernel"] = np.asarray(dequantize(L.to_kernel_orientation(v)))
    layers = {p: L.LayerQuant(weights=f) for p, f in formats.items()}
    quantized = L.quantize_linear_weights(params, cfg, layers)
    tensors: list[_Tensor] = [
        (
            "token_embd.weight",
            *_embed_tensor(params["embed.embedding"], emb_fmt, "token_embd", dtype),
        )
    ]

    def add_float(tname, x, dt=dtype):
        tensors.append((tname, *_float_tensor(x, dt)))

    others = [sub for sub in _OTHER_NAMES if sub in block_param_shapes(cfg)]
    for i in range(cfg.n_layers):
        for sub in others:
            p = f"layers.{i}.{sub}"
            x = _stored_norm(cfg, p, np.asarray(jnp.asarray(params[p], jnp.float32)))
            add_float(_param_tensor(p), _rope_order(arch, p, x, cfg.head_dim), "float32")
    for p in linear_paths(cfg):
        tname = tensor_name(p)
        w = quantized[p]
        w = (
            L.to_hf_orientation(w)
            if isinstance(w, QArray)
            else np.asarray(jnp.asarray(w, jnp.float32)).T
        )
        w = _rope_order(arch, f"{p}.kernel", w, cfg.head_dim)
        if isinstance(w, QArray):
            tensors.append((f"{tname}.weight", *gguf_tensor(w, tname)))
            if w.spec.has_global_scale:
                tensors.append(
                    (f"{tname}.scale", np.asarray(w.global_scale, np.float32).reshape(1), None)
                )
        else:
            if not np.isfinite(w).all():
                raise ValueError(f"{tname}: non-finite weights; refusing to write them")
            add_float(f"{tname}.weight", w)
    final = np.asarray(jnp.asarray(params["final_norm.scale"], jnp.float32))
    add_float("output_norm.weight", _stored_norm(cfg, "final_norm.scale", final), "float32")
    freqs = gguf_rope(cfg).freqs
    if freqs is not None:
        add_float(ROPE_FREQS, freqs, "float32")
    if not cfg.tie_embeddings:
        head = np.asarray(jnp.asarray(params["lm_head.kernel"], jnp.float32)).T
        tensors.append(("output.weight", *_embed_tensor(head, emb_fmt, "output", dtype)))
    return tensors


def _is_norm(path: str) -> bool:
    """Whether parameter ``path`` is an RMSNorm weight (``...norm.scale``)."""
    return path.endswith("norm.scale")


def _stored_norm(cfg: ModelConfig, path: str, x: np.ndarray) -> np.ndarray:
    """A float32 parameter as stored: a norm weight as the factor it multiplies by
    (``norm_offset + w``, in float32 as microscale's norm computes it)."""
    if not _is_norm(path) or not cfg.arch.norm_offset:
        return x
    return (np.float32(cfg.arch.norm_offset) + x).astype(np.float32)


def _write_file(
    out: Path, name: str, cfg: ModelConfig, vocab: GGUFVocab, tensors: list[_Tensor]
) -> dict[str, Any]:
    """The file: the metadata of ``cfg``'s architecture, the tokenizer, checksums,
    ``tensors``; written to a temporary sibling and renamed. Returns the tokenizer entry."""
    gguf = _gguf()
    w = gguf.GGUFWriter(None, cfg.arch.gguf_arch)  # every key below: "{arch}." + key
    w.add_name(name)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    arch = _ARCHS[cfg.arch.gguf_arch]
    if cfg.attn_head_dim is not None or arch.head_dim_keys:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_theta))
    gguf_rope(cfg).write(w, cfg.rope_scaling)
    w.add_layer_norm_rms_eps(float(cfg.norm_eps))
    if arch.swa_pattern:  # no window: one covering the context (the same attention)
        w.add_sliding_window(cfg.sliding_window or cfg.max_seq_len)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_string(MS_FAMILY_KEY, cfg.family)
    tok = _add_tokenizer(w, vocab, cfg.vocab_size)
    # Checksums (gguffile's module doc): of each tensor's bytes as they will be stored, and
    # of the header, filled in once the file is written (a fixed-width placeholder first).
    sums = crc32_many({tname: arr for tname, arr, _ in tensors})
    w.add_string(CRC_TENSORS_KEY, json.dumps(sums, sort_keys=True, separators=(",", ":")))
    w.add_string(CRC_HEADER_KEY, "00000000")
    for tname, arr, raw in tensors:
        w.add_tensor(tname, arr, raw_dtype=raw)
    with atomic_writer(out, "wb") as fh:
        w.open_output_file(Path(fh.name))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        seal_gguf_header(fh.name)
    return tok
