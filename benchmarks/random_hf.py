"""A randomly initialised preset model as an HF Llama folder, to measure ``microscale
quantize`` at a size (memory, time per phase) without downloading weights.

    python benchmarks/random_hf.py --preset llama_1b --tokenizer /tmp/smollm2-hf/tokenizer.json \\
        --out /tmp/llama1b-hf

The folder holds bf16 safetensors (``microscale.export.export_checkpoint``) and the given
``tokenizer.json`` (its ids must fit the preset's vocabulary). Layers are written unscanned
(the HF layout); the weights are the preset's random initialisation (seed ``--seed``), so
perplexities are meaningless: only sizes, memory and times are.
"""

from __future__ import annotations

import argparse
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama_1b", help="ModelConfig preset name")
    ap.add_argument("--tokenizer", required=True, help="a tokenizer.json to ship with it")
    ap.add_argument("--out", required=True, help="the HF folder to write (must not exist)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from flax import nnx

    from microscale.data import load_tokenizer
    from microscale.export import export_checkpoint
    from microscale.model import ModelConfig, Transformer

    cfg = getattr(ModelConfig, args.preset)().replace(scan_layers=False, remat="none")
    t = time.perf_counter()
    model = Transformer(cfg, rngs=nnx.Rngs(args.seed))
    export_checkpoint(
        model,
        args.out,
        layer_formats="bf16",
        dtype="bfloat16",
        tokenizer=load_tokenizer(args.tokenizer),
    )
    print(
        f"{args.preset}: {cfg.num_params():,} parameters -> {args.out} in "
        f"{time.perf_counter() - t:.0f}s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
