"""Quantized GEMMs for training: recipes, a custom-VJP ``dot_general``, backends.

``make_dot_general(recipe, key=...)`` returns a drop-in for ``jax.lax.dot_general``
whose forward GEMM and both gradient GEMMs quantize their operands as the
:class:`Recipe` says (see ``recipe.py`` for the preset table and ``dot.py`` for the math).
"""

from microscale.ops.backend import device_capability, native_supported, resolve_backend
from microscale.ops.dot import (
    TensorSplit,
    init_amax_history,
    make_dot_general,
    operand_key,
    qdot,
    quantize_operand,
    quantized_dot_general,
)
from microscale.ops.loss import cross_entropy, token_nll
from microscale.ops.recipe import (
    BF16_PARTS,
    GEMMS,
    RECIPES,
    SLOTS,
    OperandSpec,
    Recipe,
    RecipeLike,
    get_recipe,
    list_recipes,
    recipe_name,
)

__all__ = [
    "BF16_PARTS",
    "GEMMS",
    "RECIPES",
    "SLOTS",
    "OperandSpec",
    "Recipe",
    "RecipeLike",
    "TensorSplit",
    "cross_entropy",
    "device_capability",
    "get_recipe",
    "init_amax_history",
    "list_recipes",
    "make_dot_general",
    "native_supported",
    "operand_key",
    "qdot",
    "quantize_operand",
    "quantized_dot_general",
    "recipe_name",
    "resolve_backend",
    "token_nll",
]
