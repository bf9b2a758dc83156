"""microscale: NVFP4 training, verification and adaptive quantization in JAX."""

from microscale.formats import FormatSpec, QArray, dequantize, fake_quantize, get_format, quantize

__version__ = "0.1.0"

__all__ = ["FormatSpec", "QArray", "__version__", "dequantize", "fake_quantize", "get_format",
           "quantize"]
