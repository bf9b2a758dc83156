"""Inference on packed weights: KV-cache generation, perplexity, memory accounting.

    from microscale.inference import GenerationConfig, evaluate_ppl, load_model

    model = load_model("out/nvfp4")                       # exported folder or training run
    text = model.generate_text(["def main("], GenerationConfig(max_new_tokens=64,
                               temperature=0.8, top_p=0.95), key=jax.random.key(0))
    print(model.memory_stats().summary())                 # packed bytes vs BF16: ~4.5/16
    evaluate_ppl(model, val_batches)                      # {"ppl", "nll", "tokens"}

Quantized layers stay packed in memory (NVFP4: uint8 codes + float8_e4m3 block scales +
one float32) and are decoded layer by layer inside the jitted forward pass (W4A16);
``activations=True`` also quantizes each layer's inputs (W4A4 emulation). See
:mod:`microscale.inference.engine` for the math, the KV cache and left-padded batching,
and :mod:`microscale.inference.sampling` for greedy / temperature / top-k / top-p.
"""

from microscale.inference.engine import Linear, build_weights, forward, init_cache
from microscale.inference.model import (
    GenerationResult,
    InferenceModel,
    MemoryStats,
    evaluate_ppl,
    is_run_dir,
    load_model,
)
from microscale.inference.sampling import GenerationConfig, sample_logits

__all__ = [
    "GenerationConfig",
    "GenerationResult",
    "InferenceModel",
    "Linear",
    "MemoryStats",
    "build_weights",
    "evaluate_ppl",
    "forward",
    "init_cache",
    "is_run_dir",
    "load_model",
    "sample_logits",
]
