"""Llama-style decoder in Flax NNX, presets, and per-layer precision rules.

* `ModelConfig` (presets: ``list_presets()``); `RopeScaling` / `ROPE_KINDS` — RoPE's
  context extensions (``microscale.model.rope``).
* `Transformer` — every projection a `QLinear` through ``microscale.ops``' quantized
  ``dot_general``; embeddings, norms, attention products and the LM head high precision.
* `PrecisionRules` / `apply_rules` / `late_switch` — which recipe each linear layer runs,
  for microscale's model or any Flax NNX model.
* `LOGICAL_AXES` / `logical_to_mesh_rules` / `partition_specs` — sharding annotations.

The model never quantizes by itself: formats live in ``microscale.formats``, recipes in
``microscale.ops``.
"""

from microscale.model.config import ModelConfig, list_presets
from microscale.model.family import FAMILIES, Family, get_family
from microscale.model.layers import Embed, LMHead, QLinear, RMSNorm, apply_rope, rope_tables
from microscale.model.rope import ROPE_KINDS, RopeScaling
from microscale.model.rules import (
    BF16_LAYOUTS,
    PrecisionRules,
    apply_rules,
    assignments,
    default_bf16_last,
    iter_linears,
    late_switch,
    path_id,
    path_key,
    quantized_blocks,
    recipe_name,
    rules_for_training,
)
from microscale.model.sharding import (
    LOGICAL_AXES,
    MESH_AXES,
    logical_to_mesh_rules,
    logical_to_mesh_spec,
    param_logical_axes,
    partition_specs,
    var_logical_axes,
)
from microscale.model.transformer import (
    BLOCK_LINEARS,
    FUSED_LINEARS,
    MLP,
    Attention,
    Block,
    Transformer,
    block_param_shapes,
    causal_attention,
    filled,
    fused_groups,
    linear_paths,
    param_shapes,
)

__all__ = [
    "BF16_LAYOUTS",
    "BLOCK_LINEARS",
    "FUSED_LINEARS",
    "filled",
    "fused_groups",
    "linear_paths",
    "FAMILIES",
    "Family",
    "LOGICAL_AXES",
    "MESH_AXES",
    "MLP",
    "Attention",
    "Block",
    "Embed",
    "LMHead",
    "ModelConfig",
    "PrecisionRules",
    "QLinear",
    "ROPE_KINDS",
    "RMSNorm",
    "RopeScaling",
    "Transformer",
    "apply_rope",
    "apply_rules",
    "assignments",
    "block_param_shapes",
    "causal_attention",
    "default_bf16_last",
    "get_family",
    "iter_linears",
    "late_switch",
    "list_presets",
    "logical_to_mesh_rules",
    "logical_to_mesh_spec",
    "param_logical_axes",
    "param_shapes",
    "partition_specs",
    "path_id",
    "path_key",
    "quantized_blocks",
    "recipe_name",
    "rope_tables",
    "rules_for_training",
    "var_logical_axes",
]
