"""A llama.cpp GGUF file -> an HF folder of its family (the inverse of ``write_gguf``'s layout).

``gguf_to_hf(GGUF, OUT)`` writes ``config.json`` (the family's, from the GGUF metadata:
``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` or
``Gemma3ForCausalLM``),
``model.safetensors`` (float32, every tensor decoded with ``gguf.quants``; a weight with a
``<name>.scale`` tensor, NVFP4's FP32 tensor scale, times it, as llama.cpp multiplies it
onto the matmul), and the tokenizer (:func:`~microscale.export.gguf.vocab.hf_tokenizer`:
``tokenizer.json`` and ``tokenizer_config.json``). ``microscale import --model OUT`` then reads it
as any HF folder.

The file is read through microscale's validating parser
(:func:`~microscale.export.gguffile.open_gguf`: a damaged header fails at once, naming the
byte); the folder is written as every export is: into a temporary sibling that replaces
``OUT`` once complete (:func:`~microscale.files.atomic_folder`), the safetensors with a
CRC-32 per tensor (:func:`~microscale.export.tensorfile.write_safetensors`).

The family: ``microscale.family`` when the file has it (microscale's writer records it;
it must be a family of the file's architecture), else the one of
``general.architecture``: ``llama`` -> Llama (llama.cpp's converter writes Mistral as
llama too), ``qwen2`` -> Qwen2 (``blk.N.attn_{q,k,v}.bias``), ``qwen3`` -> Qwen3
(``blk.N.attn_{q,k}_norm.weight``), ``gemma3`` -> Gemma 3 (its four norms per block).
``{arch}.attention.key_length`` sets ``head_dim`` when it is not ``embedding_length /
head_count``. Norm weights are stored as the factor the norm multiplies by: Gemma 3's
offset of 1 is taken off again (``w = stored - 1``, exact in float32 for stored factors in
[0.5, 2], so ``1 + w`` gives the stored factor back).

``gemma3``'s layers are read as llama.cpp runs them: ``{arch}.attention.sliding_window``
(none when absent or as long as the context), one global layer in
``{arch}.attention.sliding_window_pattern`` (default 6), local RoPE base
``{arch}.rope.freq_base_swa`` (default 10000), ``query_pre_attn_scalar`` ``head_dim``
(``d_model // n_heads`` at 62 layers, llama.cpp's 27B); a final logit softcapping is
refused (microscale's block has none).

llama.cpp's ``llama`` graph applies RoPE to adjacent pairs; HF to halves, so
``convert_hf_to_gguf.py`` permutes the rows of q/k (and of their biases) per head (heads of
q: ``n_heads``, of k: ``n_kv_heads``) to ``0, hd/2, 1, hd/2 + 1, ...`` (microscale's GGUF
writer does the same, :func:`~microscale.export.gguf.writer.write_gguf`); here the rows go back.
``qwen2`` / ``qwen3`` rotate halves, as HF: their rows are read as they are.

The decoded weights are what llama.cpp computes with: a quantized GGUF (e.g. Q4_1) gives a
float model whose weights lie on that format's grid, a fine reference for comparing
quantizers against each other but not the original training-precision model.

Supported: ``general.architecture`` ``llama``, ``qwen2``, ``qwen3`` or ``gemma3`` with the ``gpt2``
(byte-level BPE) tokenizer and a pre-tokenizer among ``gpt-2`` / ``smollm`` / ``llama-bpe``
(what :mod:`~microscale.export.gguf` writes); anything else is refused, naming the key, as
is a tensor the family's model has no place for. RoPE scaling (linear, yarn, llama3's
``rope_freqs.weight``) is read back by :func:`~microscale.export.gguf.rope.read_gguf_rope`
into ``config.json``'s RoPE keys.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from microscale.export.gguf.arch import (
    ARCHS,
    MS_FAMILY_KEY,
    Arch,
    is_norm,
    param_tensor,
    stored_rows,
)
from microscale.export.gguf.rope import ROPE_FREQS, read_gguf_rope
from microscale.export.gguf.vocab import hf_tokenizer
from microscale.export.gguffile import GGUFContents, open_gguf
from microscale.export.hf import hf_config, hf_param_name, ms_param_name
from microscale.export.tensorfile import SINGLE_NAME, write_safetensors
from microscale.files import atomic_folder, atomic_write_json, atomic_write_text
from microscale.model import FAMILIES, ModelConfig, param_shapes

__all__ = ["gguf_model_config", "gguf_to_hf", "read_gguf_params"]


def _file_arch(file: GGUFContents) -> Arch:
    arch = file.value("general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"GGUF general.architecture={arch!r}: expected one of {sorted(ARCHS)}")
    return ARCHS[arch]


def _family(file: GGUFContents, arch: Arch) -> str:
    """The file's family: microscale's record (a family of ``arch``), else ``arch``'s."""
    fam = file.value(MS_FAMILY_KEY, arch.family)
    if fam not in FAMILIES or FAMILIES[fam].gguf_arch != arch.name:
        known = sorted(f.name for f in FAMILIES.values() if f.gguf_arch == arch.name)
        raise ValueError(
            f"GGUF {MS_FAMILY_KEY}={fam!r}: not a family of general.architecture="
            f"{arch.name!r} (expected one of {known})"
        )
    return fam


def gguf_model_config(file: GGUFContents) -> ModelConfig:
    """The ``ModelConfig`` of a GGUF (read by :func:`~microscale.export.gguffile.open_gguf`)
    from its metadata: the family (the module doc), the shape, RoPE."""
    arch = _file_arch(file)
    a = arch.name + "."
    n_vocab = file.value(a + "vocab_size", None)
    if n_vocab is None:
        n_vocab = len(file.value("tokenizer.ggml.tokens"))
    d = int(file.value(a + "embedding_length"))
    n_heads = int(file.value(a + "attention.head_count"))
    hd = int(file.value(a + "attention.key_length", d // n_heads))
    value = int(file.value(a + "attention.value_length", hd))
    if value != hd:
        raise ValueError(
            f"GGUF {a}attention.value_length={value}: microscale's heads have one width "
            f"(key_length {hd})"
        )
    rot = file.value(a + "rope.dimension_count", hd)
    if rot != hd:
        raise ValueError(
            f"GGUF {a}rope.dimension_count={rot}: partial RoPE is not supported "
            f"(expected head_dim {hd})"
        )
    names = {t.name for t in file.tensors}
    if ROPE_FREQS in names and not arch.rope_freqs:
        raise ValueError(f"GGUF {ROPE_FREQS}: llama.cpp's {arch.name} graph does not read it")
    cfg = ModelConfig(
        **_layer_kinds(file, arch, n_heads, d),
        family=_family(file, arch),
        vocab_size=int(n_vocab),
        d_model=d,
        n_layers=int(file.value(a + "block_count")),
        n_heads=n_heads,
        n_kv_heads=int(file.value(a + "attention.head_count_kv", n_heads)),
        d_ff=int(file.value(a + "feed_forward_length")),
        attn_head_dim=None if n_heads * hd == d else hd,
        max_seq_len=int(file.value(a + "context_length")),
        rope_theta=float(file.value(a + "rope.freq_base", 10000.0)),
        norm_eps=float(file.value(a + "attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in names,
        dim_multiple=16,
    )
    rope = read_gguf_rope(file, cfg)
    return cfg if rope is None else cfg.replace(rope_scaling=rope)


def _layer_kinds(file: GGUFContents, arch: Arch, n_heads: int, d: int) -> dict[str, Any]:
    """The local/global layer fields of a ``ModelConfig`` for a file of ``arch`` (what its
    graph reads; none for an architecture without local layers)."""
    if not arch.swa_pattern:
        return {}
    a = arch.name + "."
    cap = file.value(a + "final_logit_softcapping", None)
    if cap:
        raise ValueError(
            f"GGUF {a}final_logit_softcapping={cap}: microscale's {arch.family} model has no "
            "logit softcapping"
        )
    n_layers = int(file.value(a + "block_count"))
    window = file.value(a + "attention.sliding_window", None)
    context = int(file.value(a + "context_length"))
    pattern = file.value(a + "attention.sliding_window_pattern", arch.swa_pattern)
    if not isinstance(pattern, int):
        raise ValueError(
            f"GGUF {a}attention.sliding_window_pattern={pattern!r}: microscale reads one "
            "period (an int), not a per-layer list"
        )
    local = window is not None and int(window) > 0
    wide = n_layers == arch.wide_scale_layers
    return {
        "sliding_window": int(window) if local and int(window) < context else None,
        "sliding_window_pattern": pattern if local else 0,
        "rope_local_theta": (
            float(file.value(a + "rope.freq_base_swa", arch.swa_theta)) if local else None
        ),
        "query_pre_attn_scalar": float(d // n_heads) if wide else None,
    }


def _decoded(file: GGUFContents) -> dict[str, np.ndarray]:
    """Every tensor decoded to float32 in numpy (row-major, GGUF ``ne`` reversed); a
    ``<name>.scale`` tensor is multiplied onto ``<name>.weight`` (exact: float32 products,
    as ggml's) and dropped."""
    out = {t.name: file.decode(t) for t in file.tensors}
    for name in [n for n in out if n.endswith(".scale")]:
        weight = name[: -len(".scale")] + ".weight"
        if weight in out:
            out[weight] = out[weight] * out.pop(name).reshape(())
    return out


def _hf_tensors(file: GGUFContents, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """{HF tensor name: float32 array} of every parameter of ``cfg``'s model (weights in HF
    ``[out, in]`` orientation, q/k rows back in HF's order); a tensor of the file that none
    of them reads is refused, naming it."""
    arch = ARCHS[cfg.arch.gguf_arch]
    src = _decoded(file)
    src.pop(ROPE_FREQS, None)  # read by gguf_model_config (read_gguf_rope)
    out = {}
    for p in param_shapes(cfg):
        name = param_tensor(p)
        if name not in src:
            raise ValueError(f"GGUF tensor {name!r} is missing (a {cfg.family} model has it)")
        w = src.pop(name)
        rows = stored_rows(arch, p, w.shape[0], cfg.head_dim)
        if rows is not None:
            back = np.empty_like(w)
            back[rows] = w  # the writer's rows, undone
            w = back
        if is_norm(p) and cfg.arch.norm_offset:  # the writer's (converter's) + 1, undone
            w = (w - np.float32(cfg.arch.norm_offset)).astype(np.float32)
        out[hf_param_name(p, cfg.family)] = w
    if src:
        raise ValueError(
            f"GGUF tensor {sorted(src)[0]!r}: microscale's {cfg.family} model has no "
            f"such parameter (general.architecture={arch.name!r})"
        )
    return out


def read_gguf_params(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], ModelConfig]:
    """``({parameter path: float32 array}, ModelConfig)`` of the GGUF file ``path``: every
    tensor decoded to float32, kernels ``[in, out]`` (RoPE rows in microscale's order)."""
    file = open_gguf(path)
    cfg = gguf_model_config(file)
    flat = {}
    for name, arr in _hf_tensors(file, cfg).items():
        p = ms_param_name(name, cfg.family)
        flat[p] = np.ascontiguousarray(arr.T) if p.endswith(".kernel") else arr
    return flat, cfg


def gguf_to_hf(path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the HF folder of the GGUF file ``path`` into ``out_dir`` (created; an
    existing non-empty folder is refused). Returns ``out_dir``."""
    path, out = Path(path), Path(out_dir)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {str(out)!r} exists and is not an empty folder")
    file = open_gguf(path)
    cfg = gguf_model_config(file)
    tok, tok_conf = hf_tokenizer(file, cfg.max_seq_len)
    tensors = _hf_tensors(file, cfg)
    ids = {k: file.value(f"tokenizer.ggml.{k}_token_id", None) for k in ("bos", "eos")}
    config = hf_config(cfg, dtype="float32", eos_token_id=ids["eos"], bos_token_id=ids["bos"])
    # An empty ``out`` is replaced by the complete folder (microscale.files.atomic_folder).
    with atomic_folder(out, overwrite=True) as tmp:
        write_safetensors(tmp / SINGLE_NAME, tensors, metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", config)
        atomic_write_text(tmp / "tokenizer.json", tok.to_str(pretty=True) + "\n")
        atomic_write_json(tmp / "tokenizer_config.json", tok_conf)
    return out
