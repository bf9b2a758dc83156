"""Model families: what a decoder block of each architecture computes, as one row of data.

Every family microscale runs is a Llama-style pre-norm decoder; a family row says where it
departs from Llama, and ``model.block`` is the one block definition that reads the row, for
training, PTQ scoring, evaluation and KV-cache generation alike. Rows, not a module per
family (MaxText's layout) or inherited classes (transformers' ``modular_*.py``): the
families here differ by a handful of switches inside one block, so a row keeps each switch
in one place and a new family that only recombines them is one row plus its tests. A
family whose block has a different shape (an extra sub-layer, a different residual
order) would get its own branch in ``model.block`` behind a switch of its row.

===========  ============  ========  =======  ==============  ==========================
family       HF model_type  q/k/v     q/k      sliding window  GGUF architecture
                            biases    norms
===========  ============  ========  =======  ==============  ==========================
llama        llama          no        no       no              llama
mistral      mistral        no        no       optional        llama (llama.cpp's choice)
qwen2        qwen2          yes       no       no              qwen2
qwen3        qwen3          no        yes      no              qwen3
gemma3       gemma3_text    no        yes      local layers    gemma3
===========  ============  ========  =======  ==============  ==========================

* **q/k/v biases** (Qwen2/2.5): ``q = n Wq + bq`` (likewise k, v); ``o_proj`` has none.
  A bias is a float32 parameter ``layers.<i>.attn.<q|k|v>_proj.bias`` that no recipe
  quantizes; it is added after the GEMM, in float32.
* **q/k norms** (Qwen3): RMSNorm over each head's ``head_dim`` values of q and of k (one
  ``[head_dim]`` weight each, shared by the heads: ``layers.<i>.attn.q_norm.scale``,
  ``k_norm.scale``), after the projection and before RoPE.
* **sliding window** (Mistral v0.1): a query at position ``i`` attends to keys ``j`` with
  ``i - window < j <= i`` (``ModelConfig.sliding_window``; ``None``: every earlier key).
* **Gemma 3** departs further, each a switch of its row: RMSNorm multiplies by ``1 + w``
  (``norm_offset``; checkpoints store ``w``, zeros at init), the embedding is scaled by
  ``sqrt(d_model)`` (``embed_scale``), the MLP is GeGLU with tanh-GELU (``mlp_act``), each
  sub-layer's output is normed before its residual add (``post_norms``: four norms per
  block), q/k norms, and local layers (a sliding window and their own RoPE base,
  ``ModelConfig.rope_local_theta``) beside global ones, one global layer in every
  ``ModelConfig.sliding_window_pattern`` (``local_global``). The attention's
  ``query_pre_attn_scalar`` is ``ModelConfig.query_pre_attn_scalar``.
* The explicit ``head_dim`` of Qwen3 and Mistral (``ModelConfig.attn_head_dim``) is a
  shape, not a family switch: any family may have one.
"""

from __future__ import annotations

import dataclasses

__all__ = ["FAMILIES", "Family", "get_family"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """One architecture's departures from the Llama block, and its names outside."""

    name: str  # microscale's name (ModelConfig.family)
    hf_model_type: str  # config.json's model_type
    hf_architecture: str  # config.json's architectures[0] (transformers' model class)
    gguf_arch: str  # llama.cpp's general.architecture (its tensor names and keys)
    qkv_bias: bool = False  # q/k/v projections carry a float32 bias; o_proj does not
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE
    sliding_window: bool = False  # admits ModelConfig.sliding_window (all layers alike)
    # Local (sliding-window, own RoPE base) and global layers by ModelConfig's
    # sliding_window_pattern; admits sliding_window, rope_local_theta, the pattern.
    local_global: bool = False
    norm_offset: float = 0.0  # every RMSNorm multiplies by (norm_offset + w); init 1 - offset
    post_norms: bool = False  # each sub-layer's output RMSNorm-ed before its residual add
    mlp_act: str = "silu"  # the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: bool = False  # the embedding times sqrt(d_model) into the residual stream


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(name="llama", hf_model_type="llama", hf_architecture="LlamaForCausalLM",
               gguf_arch="llama"),
        Family(name="mistral", hf_model_type="mistral", hf_architecture="MistralForCausalLM",
               gguf_arch="llama", sliding_window=True),
        Family(name="qwen2", hf_model_type="qwen2", hf_architecture="Qwen2ForCausalLM",
               gguf_arch="qwen2", qkv_bias=True),
        Family(name="qwen3", hf_model_type="qwen3", hf_architecture="Qwen3ForCausalLM",
               gguf_arch="qwen3", qk_norm=True),
        Family(name="gemma3", hf_model_type="gemma3_text", hf_architecture="Gemma3ForCausalLM",
               gguf_arch="gemma3", qk_norm=True, local_global=True, norm_offset=1.0,
               post_norms=True, mlp_act="gelu_tanh", embed_scale=True),
    )
}  # fmt: skip


def get_family(name: str) -> Family:
    """The row of family ``name``; an unknown name raises, listing the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(
            f"unknown model family {name!r}; expected one of {sorted(FAMILIES)}"
        ) from None
