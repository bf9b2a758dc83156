"""Decode speed on packed NVFP4 weights vs BF16 weights, on this machine, in one run.

The same randomly initialised model (default: the ``small`` preset shape, ~25M params)
runs ``microscale.inference`` greedy generation (batch 1 by default, KV cache, prefill
then one token per step inside one jitted loop) with:

  * bf16      dense BF16 weights (the baseline);
  * nvfp4     packed NVFP4 weights (uint8 codes + E4M3 scales), decoded layer by layer
              inside the step (W4A16);
  * nvfp4-a4  the same plus NVFP4 quantization of every layer input (W4A4 emulation);
  * f32       dense float32 weights (what XLA:CPU multiplies fastest).

Decode tokens/s = generated tokens / (time of a prompt + N tokens - time of the prompt +
1 token), so prefill and compilation are excluded. Also printed: resident weight bytes of
the linear layers. Ratios are against bf16.

With a llama.cpp binding installed (``pip install '.[llama]'``, build flags in
docs/llamacpp.md), the same weights are also exported to GGUF in NVFP4, MXFP4, Q8_0 and BF16
(embeddings and the tied LM head stay BF16 in all four) and llama.cpp's greedy decode
(batch 1, one ``llama_decode`` per token, prefill excluded) is timed on each, in the same
run: the on-device path next to microscale's own engine. ``--gguf-only`` skips the
microscale rows. Use a model large enough to be memory-bound (``--preset gpt2-124m``).

Run:  python benchmarks/decode.py [--preset small] [--tokens 128] [--batch 1] [--repeats 3]
      python benchmarks/decode.py --preset gpt2-124m --tokens 64 --repeats 2   # + llama.cpp
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from microscale.inference import GenerationConfig, InferenceModel
from microscale.model import ModelConfig, Transformer


def _time(model: InferenceModel, prompts, n: int, repeats: int) -> float:
    gen = GenerationConfig(max_new_tokens=n)
    model.generate(prompts, gen)  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.generate(prompts, gen)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", help="model shape preset (default: small)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--gguf-only",
        action="store_true",
        help="only the llama.cpp GGUF rows (needs a llama.cpp binding)",
    )
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all)")
    args = ap.parse_args()

    cfg = ModelConfig.preset(args.preset)
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, args.prompt_len + args.tokens + 16))
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (args.batch, args.prompt_len)).tolist()
    variants = {
        "bf16": dict(compute_dtype="bfloat16"),
        "nvfp4": dict(formats="nvfp4", compute_dtype="bfloat16"),
        "nvfp4-a4": dict(formats="nvfp4", activations=True, compute_dtype="bfloat16"),
        "f32": dict(compute_dtype="float32"),
    }
    print(
        f"# decode, {args.preset} ({cfg.num_params() / 1e6:.1f}M params), batch "
        f"{args.batch}, prompt {args.prompt_len}, {args.tokens} new tokens, "
        f"{jax.devices()[0].platform}"
    )
    print("| weights | decode tokens/s | x bf16 | linear weight MiB | x bf16 |")
    print("|---|---:|---:|---:|---:|")
    rows = []
    for name, kw in ({} if args.gguf_only else variants).items():
        f32 = kw["compute_dtype"] == "float32"
        im = InferenceModel.from_params(model, cfg.replace(compute_dtype=kw["compute_dtype"]), **kw)
        t_full = _time(im, prompts, args.tokens, args.repeats)
        t_one = _time(im, prompts, 1, args.repeats)
        tps = args.batch * (args.tokens - 1) / max(t_full - t_one, 1e-9)
        st = im.memory_stats()
        mib = (st.quantized_bytes + st.dense_linear_bytes) / 2**20
        rows.append((name, tps, mib))
        base_tps, base_mib = rows[0][1], rows[0][2]
        print(
            f"| {name}{' (float32 compute)' if f32 else ''} | {tps:.1f} | "
            f"{tps / base_tps:.2f} | {mib:.2f} | {mib / base_mib:.3f} |"
        )
    _llama_cpp_rows(model, cfg, prompts[0], args)


def _llama_cpp_rows(model, cfg: ModelConfig, prompt: list[int], args) -> None:
    """The same weights as GGUF files, decoded by llama.cpp (when a binding is installed)."""
    import tempfile
    from pathlib import Path

    from microscale.data import ByteTokenizer
    from microscale.export.gguf.llamacpp import LlamaCpp, llama_cpp_available
    from microscale.export.gguf.writer import write_gguf

    if llama_cpp_available() is None:
        print("\n(llama.cpp rows skipped: pip install '.[llama]' or set MICROSCALE_LIBLLAMA)")
        return
    print(
        f"\n# llama.cpp ({llama_cpp_available()}) on GGUF exports of the same weights, "
        f"batch 1, {args.tokens} new tokens, best of {args.repeats}"
    )
    print("| GGUF linear layers | decode tokens/s | x BF16 GGUF | file MiB | x BF16 GGUF |")
    print("|---|---:|---:|---:|---:|")
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("bf16", "nvfp4", "mxfp4", "q8_0"):
            path = Path(tmp) / f"{fmt}.gguf"
            write_gguf(model, path, config=cfg, layer_formats=fmt, tokenizer=ByteTokenizer())
            llm = LlamaCpp(path, n_ctx=len(prompt) + args.tokens + 8, n_threads=args.threads)
            tps = max(llm.greedy(prompt, args.tokens)[1] for _ in range(args.repeats))
            llm.close()
            mib = path.stat().st_size / 2**20
            base = base or (tps, mib)
            print(f"| {fmt} | {tps:.1f} | {tps / base[0]:.2f} | {mib:.1f} | {mib / base[1]:.3f} |")
            path.unlink()


if __name__ == "__main__":
    main()
