"""Block-sequential GPTQ (``microscale.ptq.sequential``) on an HF folder: peak memory and
time per block, at any model size.

    python benchmarks/sequential_ptq.py --model /tmp/smollm2-hf --text corpus.txt

Calibration: ``--tokens`` tokens (quantize's default, 65,536) in windows of
``--seq`` tokens, ``--rows`` per batch (``microscale.ptq.run.calibration_windows``, seed 0),
from ``--text`` tokenized with the folder's ``tokenizer.json``; without ``--text``, uniform
random token ids (enough for memory and time, not for quality). Every linear layer gets
``--format`` (default nvfp4). Prints, per block, its wall seconds and the process's peak
resident memory so far (Linux ``VmHWM``), then the totals and the load average.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import jax
import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="an HF folder of float safetensors")
    ap.add_argument("--text", help="calibration text (UTF-8); default: random token ids")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--format", default="nvfp4")
    ap.add_argument("--inputs", default="quantized", choices=["quantized", "original"])
    args = ap.parse_args()

    from microscale.data import load_tokenizer
    from microscale.model import linear_paths
    from microscale.ptq.phases import peak_rss_gb
    from microscale.ptq.run import calibration_windows
    from microscale.ptq.sequential import folder_source, sequential_gptq

    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    src = folder_source(args.model)
    cfg = src.config
    if args.text:
        tok = load_tokenizer(str(Path(args.model) / "tokenizer.json"))
        ids = np.asarray(tok.encode(Path(args.text).read_text(encoding="utf-8")), np.int64)
    else:
        ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 4 * args.tokens)
    batches = calibration_windows(
        ids, n_tokens=args.tokens, seq_len=args.seq, rows=args.rows, seed=0
    )
    print(
        f"{args.model}: {cfg.family}, {cfg.n_layers} blocks, {cfg.num_params():,} parameters; "
        f"{batches.shape[0]} batches x {args.rows} x {args.seq} tokens; {args.format}, "
        f"inputs={args.inputs}",
        flush=True,
    )
    last = [time.perf_counter()]

    def progress(i: int) -> None:
        now = time.perf_counter()
        print(
            f"  block {i:3d}: {now - last[0]:6.1f} s, peak RSS {peak_rss_gb():.2f} GiB", flush=True
        )
        last[0] = now

    formats = dict.fromkeys(linear_paths(cfg), args.format)
    packed = [0]

    def sink(path, weight) -> None:  # counted, then dropped: the memory of one block
        packed[0] += sum(x.nbytes for x in jax.tree.leaves(weight.qarray))

    out = sequential_gptq(
        src, list(batches), formats, inputs=args.inputs, progress=progress, sink=sink
    )
    wall = time.perf_counter() - t0
    print(
        f"{len(formats)} layers ({packed[0] / 2**30:.2f} GiB packed) over {out.tokens:,} "
        f"tokens in {wall:.0f} s; "
        f"peak RSS {peak_rss_gb():.2f} GiB; load average {load0:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
