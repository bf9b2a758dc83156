"""microscale: NVFP4 training, verification and adaptive quantization in JAX.

import microscale as ms
q = ms.quantize(x, "nvfp4")                  # QArray: packed E2M1 codes + E4M3 scales
y = ms.qdot(x, w, "nvfp4", key=key)          # the NVFP4 training recipe, custom VJP
dense = nnx.Linear(..., dot_general=ms.make_dot_general("nvfp4", key=key))
"""

from microscale.formats import FormatSpec, QArray, dequantize, fake_quantize, get_format, quantize
from microscale.ops import Recipe, get_recipe, list_recipes, make_dot_general, qdot

__version__ = "0.1.0"

__all__ = [
    "FormatSpec",
    "QArray",
    "Recipe",
    "__version__",
    "dequantize",
    "fake_quantize",
    "get_format",
    "get_recipe",
    "list_recipes",
    "make_dot_general",
    "qdot",
    "quantize",
]
