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
===========  ============  ========  =======  ==============  ==========================

* **q/k/v biases** (Qwen2/2.5): ``q = n Wq + bq`` (likewise k, v); ``o_proj`` has none.
  A bias is a float32 parameter ``layers.<i>.attn.<q|k|v>_proj.bias`` that no recipe
  quantizes; it is added after the GEMM, in float32.
* **q/k norms** (Qwen3): RMSNorm over each head's ``head_dim`` values of q and of k (one
  ``[head_dim]`` weight each, shared by the heads: ``layers.<i>.attn.q_norm.scale``,
  ``k_norm.scale``), after the projection and before RoPE.
* **sliding window** (Mistral v0.1): a query at position ``i`` attends to keys ``j`` with
  ``i - window < j <= i`` (``ModelConfig.sliding_window``; ``None``: every earlier key).
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
