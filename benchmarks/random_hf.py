"""A randomly initialised preset model as an HF folder, written tensor by tensor, to
measure ``microscale quantize`` (and block-sequential PTQ) at a size without downloading
weights, at any size: the model is never held in memory.

    python benchmarks/random_hf.py --preset llama_8b --tokenizer /tmp/smollm2-hf/tokenizer.json \\
        --out /tmp/llama8b-hf

The folder is what HF ships: ``config.json`` (the preset's family, shape and RoPE), bf16
safetensors in shards of at most ``--shard-gb`` (``model-0000k-of-0000n.safetensors`` with
``model.safetensors.index.json``; one ``model.safetensors`` when it fits), and the given
``tokenizer.json`` (its ids must fit the preset's vocabulary). Each tensor is drawn in row
chunks of at most 64 MiB (normal with the preset's ``init_std`` for embeddings and
projections, ones for norm scales, zeros for biases; seed ``--seed``) and written as it is
drawn, so the peak memory is one chunk whatever the size. The weights are not the preset's
own initialisation (nor trained): perplexities mean nothing, only sizes, memory and times.
Each file is written atomically (``microscale.files.atomic_writer``) into a folder that
appears only when complete (``atomic_folder``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import time
from pathlib import Path

import ml_dtypes
import numpy as np

CHUNK_BYTES = 64 << 20


def _hf_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: HF shape (kernels [out, in])} of ``cfg``."""
    from microscale.export.hf import hf_param_name
    from microscale.model import param_shapes

    return {
        hf_param_name(p, cfg.family): tuple(s[::-1]) if p.endswith(".kernel") else tuple(s)
        for p, s in param_shapes(cfg).items()
    }


def _shards(tensors: dict[str, tuple[int, ...]], shard_bytes: int) -> list[list[str]]:
    """Tensors in name order, cut into shards of at most ``shard_bytes`` (a tensor larger
    than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        n = 2 * int(np.prod(tensors[name]))
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _header(names: list[str], tensors: dict[str, tuple[int, ...]]) -> bytes:
    head, off = {}, 0
    for name in names:
        n = 2 * int(np.prod(tensors[name]))
        head[name] = {"dtype": "BF16", "shape": list(tensors[name]), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_tensor(f, name: str, shape: tuple[int, ...], std: float, rng) -> None:
    if name.endswith("norm.weight"):
        f.write(np.ones(shape, ml_dtypes.bfloat16).tobytes())
        return
    if name.endswith(".bias"):
        f.write(np.zeros(shape, ml_dtypes.bfloat16).tobytes())
        return
    row = int(np.prod(shape[1:]))
    step = max(1, CHUNK_BYTES // (4 * row))
    for start in range(0, shape[0], step):
        rows = min(step, shape[0] - start)
        x = rng.standard_normal((rows, row), np.float32) * np.float32(std)
        f.write(x.astype(ml_dtypes.bfloat16).tobytes())


def write_random_hf(cfg, out: Path, tokenizer: Path, *, shard_gb: float, seed: int) -> int:
    """Write ``cfg`` as a random HF folder at ``out``; returns the bytes of weights."""
    from microscale.export.hf import hf_config
    from microscale.files import atomic_folder, atomic_writer

    tensors = _hf_tensors(cfg)
    shards = _shards(tensors, int(shard_gb * 2**30))
    rng = np.random.default_rng(seed)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    with atomic_folder(out) as tmp:
        for fname, names in zip(files, shards, strict=True):
            with atomic_writer(tmp / fname) as f:
                f.write(_header(names, tensors))
                for name in names:
                    _write_tensor(f, name, tensors[name], cfg.init_std, rng)
            print(f"  {fname}: {len(names)} tensors", flush=True)
        total = sum(2 * int(np.prod(s)) for s in tensors.values())
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": total},
                "weight_map": {n: f for f, names in zip(files, shards, strict=True) for n in names},
            }
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, dtype="bfloat16"), indent=2))
        shutil.copyfile(tokenizer, tmp / "tokenizer.json")
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama_1b", help="ModelConfig preset name")
    ap.add_argument("--tokenizer", required=True, help="a tokenizer.json to ship with it")
    ap.add_argument("--out", required=True, help="the HF folder to write (must not exist)")
    ap.add_argument("--shard-gb", type=float, default=5.0, help="largest shard (HF ships 5 GB)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from microscale.model import ModelConfig

    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"random_hf: --out {out} exists; give a new folder")
    cfg = getattr(ModelConfig, args.preset)().replace(scan_layers=False, remat="none")
    t = time.perf_counter()
    total = write_random_hf(cfg, out, Path(args.tokenizer), shard_gb=args.shard_gb, seed=args.seed)
    print(
        f"{args.preset}: {cfg.num_params():,} parameters ({total / 2**30:.2f} GiB bf16) -> "
        f"{out} in {time.perf_counter() - t:.0f}s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
