"""microscale's GGUFs against llama.cpp's own quants, measured in llama.cpp, in one run.

On an HF Llama folder (made for SmolLM2-135M-Instruct by ``benchmarks/smollm2_hf.py``; its
weights already lie on a Q4_1 grid, so "bf16" here is that dequantized model) it builds:

* ``bf16``: the folder as a BF16 GGUF (the reference, and llama.cpp's quantizer input);
* ``nvfp4``: microscale's uniform NVFP4 (plain round-to-nearest), BF16 embedding / LM head;
* ``searched-rtn`` / ``searched-gptq``: the allocations of two ``microscale quantize`` outputs
  (``--rtn`` / ``--gptq``: the NVFP4 / MXFP4 / 8-bit mix a budgeted search chose, weights as
  quantized there, byte for byte; 8-bit layers stored as Q8_0);
* each microscale variant again with ``+q8e``: the tied token embedding / LM head in Q8_0
  (``write_gguf(embed_format="q8_0")``), and ``searched-gptq+mx4e`` with it in MXFP4;
* ``llama-q4_0`` / ``llama-q4_k_m``: llama.cpp's own quantizer (``llama_model_quantize``,
  default parameters, no importance matrix) on the ``bf16`` file;
* ``--gguf NAME=PATH``: a GGUF as it is, e.g. a ``microscale quantize layout=gguf`` output's
  ``model.gguf`` (``count_other_params=true``: the search chose its token embedding's format).

``--only NAME,...`` builds and measures only those variants (``bf16`` and ``llama-q4_k_m``,
the table's references, always).

Then, in llama.cpp (``MICROSCALE_LIBLLAMA`` or llama-cpp-python), for each file: its size
and bits per weight (file bits / parameters), its tensor types, the negative log-likelihood
of ``--chunks`` windows of ``--ctx`` tokens of held-out English prose (the ``stdlib-docs``
corpus: pydoc topics and stdlib docstrings; never in any calibration set here), prefill
tokens/s of one ``--ctx``-token prompt and greedy decode tokens/s (best of ``--repeats``).
Perplexity ratios are paired over the windows: ``exp(mean_c d_c)`` with ``d_c`` a window's
NLL difference, and a Student-t 95% interval of the mean, exponentiated.

Results go to ``WORK/results/<name>.json`` (a rerun measures only what is missing; delete a
file to redo it) and the table to ``WORK/table.md``.

Run:  MICROSCALE_LIBLLAMA=/path/libllama.so python benchmarks/llamacpp_table.py \\
          --hf /tmp/smollm2-hf --rtn /tmp/q23/smol --gptq /tmp/q23g --work /tmp/llamacpp-table
      (add ``--gguf searched-embed=Q/model.gguf --only searched-embed,...`` for one more row)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np


def _variants(args) -> dict[str, tuple[str, dict]]:
    """name -> ("export", export_run kwargs) or ("llama", {"ftype": ...})."""
    out: dict[str, tuple[str, dict]] = {
        "bf16": ("export", {"source": args.hf, "formats": "bf16"}),
        "nvfp4": ("export", {"source": args.hf, "formats": "nvfp4"}),
        "nvfp4+q8e": ("export", {"source": args.hf, "formats": "nvfp4", "embed_format": "q8_0"}),
    }
    for tag, src in (("rtn", args.rtn), ("gptq", args.gptq)):
        if src:
            out[f"searched-{tag}"] = ("export", {"source": src})
            out[f"searched-{tag}+q8e"] = ("export", {"source": src, "embed_format": "q8_0"})
    if args.gptq:
        out["searched-gptq+mx4e"] = ("export", {"source": args.gptq, "embed_format": "mxfp4"})
    out["llama-q4_0"] = ("llama", {"ftype": "q4_0"})
    out["llama-q4_k_m"] = ("llama", {"ftype": "q4_k_m"})
    for item in args.gguf:
        name, _, path = item.partition("=")
        out[name] = ("file", {"path": path})
    if args.only:
        keep = {"bf16", "llama-q4_k_m", *args.only.split(",")}
        out = {k: v for k, v in out.items() if k in keep}
    return out


def build(name: str, kind: str, kw: dict, work: Path, threads: int) -> Path:
    """The GGUF of one variant (kept in ``work`` and reused)."""
    from microscale.export.gguf.llamacpp import llama_quantize
    from microscale.inference.export_run import export_run

    if kind == "file":
        return Path(kw["path"])
    path = work / f"{name}.gguf"
    if path.is_file():
        return path
    t0 = time.perf_counter()
    if kind == "export":
        kw = dict(kw)
        export_run(kw.pop("source"), path, layout="gguf", **kw)
    else:
        llama_quantize(work / "bf16.gguf", path, kw["ftype"], n_threads=threads)
    print(f"built {path.name} in {time.perf_counter() - t0:.1f}s", flush=True)
    return path


def eval_windows(llm, n_chunks: int, ctx: int) -> list[list[int]]:
    """``n_chunks`` windows of ``ctx`` tokens spread evenly over the stdlib-docs text
    (documents joined by blank lines), tokenized by llama.cpp."""
    from microscale.data.sources import read_stdlib_docs

    text = "\n\n".join(t for _, t in read_stdlib_docs().val)
    toks = llm.tokenize(text)
    if len(toks) < n_chunks * ctx:
        raise ValueError(f"stdlib-docs has {len(toks)} tokens, fewer than {n_chunks} x {ctx}")
    starts = np.linspace(0, len(toks) - ctx, n_chunks).astype(int)
    return [toks[s : s + ctx] for s in starts]


def window_nll(llm, window: list[int]) -> float:
    """Mean next-token NLL (nats) over a window's ``ctx - 1`` predictions."""
    logits = llm.logits(window)[:-1].astype(np.float64)
    m = logits.max(-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(-1))
    return float(np.mean(lse - logits[np.arange(len(window) - 1), window[1:]]))


def measure(path: Path, windows, args) -> dict:
    """Size, tensor types, per-window NLL, prefill and decode tokens/s of one file."""
    from gguf import GGUFReader

    from microscale.export.gguf.llamacpp import LlamaCpp

    r = GGUFReader(path)
    n_params = sum(int(t.n_elements) for t in r.tensors if not t.name.endswith(".scale"))
    types = Counter(
        t.tensor_type.name for t in r.tensors if t.name.endswith(".weight") and len(t.shape) == 2
    )
    embd = next(t.tensor_type.name for t in r.tensors if t.name == "token_embd.weight")
    # the linear weights (blk.* matrices): stored bits per element
    lin = [t for t in r.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    linear_bits = 8 * sum(int(t.n_bytes) for t in lin) / sum(int(t.n_elements) for t in lin)
    del r
    llm = LlamaCpp(path, n_ctx=args.ctx + 8, n_threads=args.threads, verify=False)
    t0 = time.perf_counter()
    nll = [window_nll(llm, w) for w in windows]
    t_eval = time.perf_counter() - t0
    prefill = max(llm.prefill(windows[0]) for _ in range(args.repeats))
    prompt = windows[0][:16]
    decode = max(llm.greedy(prompt, args.decode_tokens)[1] for _ in range(args.repeats))
    llm.close()
    size = path.stat().st_size
    return {
        "file_bytes": size,
        "params": n_params,
        "bpw": 8 * size / n_params,
        "types": dict(types),
        "token_embd": embd,
        "linear_bits": linear_bits,
        "nll": nll,
        "eval_s": t_eval,
        "prefill_tps": prefill,
        "decode_tps": decode,
        "load": os.getloadavg(),
    }


def _ratio(x: np.ndarray, ref: np.ndarray) -> str:
    from microscale.experiments.stats import mean_ci

    ci = mean_ci((x - ref).tolist())
    lo, hi = ci["ci95"]
    return (
        f"{100 * math.expm1(ci['mean']):+.2f}% [{100 * math.expm1(lo):+.2f}, "
        f"{100 * math.expm1(hi):+.2f}]"
    )


def table(res: dict[str, dict], ctx: int) -> str:
    """The markdown table: size, bits per weight, perplexity, paired ratios, speed."""
    ref, q4km = np.asarray(res["bf16"]["nll"]), np.asarray(res["llama-q4_k_m"]["nll"])
    base_dec = res["bf16"]["decode_tps"]
    n = len(ref)
    lines = [
        f"{n} windows x {ctx} tokens of stdlib-docs ({n * (ctx - 1)} predictions); "
        f"load average during the runs {min(r['load'][0] for r in res.values()):.2f}-"
        f"{max(r['load'][0] for r in res.values()):.2f}",
        "",
        "| GGUF | file MiB | bits/weight | linear bits | token_embd | ppl | vs Q4_K_M (95% CI) "
        "| vs bf16 (95% CI) | prefill tok/s | decode tok/s | decode x bf16 |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in sorted(res.items(), key=lambda kv: kv[1]["file_bytes"]):
        x = np.asarray(r["nll"])
        lines.append(
            f"| {name} | {r['file_bytes'] / 2**20:.1f} | {r['bpw']:.2f} | "
            f"{r.get('linear_bits', float('nan')):.2f} | {r['token_embd']} | "
            f"{math.exp(x.mean()):.3f} | {_ratio(x, q4km) if name != 'llama-q4_k_m' else ''} "
            f"| {_ratio(x, ref) if name != 'bf16' else ''} | {r['prefill_tps']:.0f} | "
            f"{r['decode_tps']:.1f} | {r['decode_tps'] / base_dec:.2f} |"
        )
    lines += ["", "Tensor types (2-D weights):", ""]
    lines += [
        f"- {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(r["types"].items()))
        for name, r in res.items()
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", required=True, help="HF Llama folder (the bf16 reference)")
    ap.add_argument("--rtn", help="a microscale quantize output (round-to-nearest search)")
    ap.add_argument("--gptq", help="a microscale quantize output (--weight-method gptq)")
    ap.add_argument("--work", required=True, help="folder for the GGUFs and results")
    ap.add_argument("--ctx", type=int, default=256, help="tokens per evaluation window")
    ap.add_argument("--chunks", type=int, default=32, help="evaluation windows")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--gguf", action="append", default=[], metavar="NAME=PATH", help="a GGUF as it is"
    )
    ap.add_argument("--only", help="comma-separated variants to build and measure")
    args = ap.parse_args()

    from microscale.export.gguf.llamacpp import LlamaCpp

    work = Path(args.work)
    (work / "results").mkdir(parents=True, exist_ok=True)
    variants = _variants(args)
    paths = {
        name: build(name, kind, kw, work, args.threads) for name, (kind, kw) in variants.items()
    }
    llm = LlamaCpp(paths["bf16"], n_ctx=16, n_threads=args.threads)
    windows = eval_windows(llm, args.chunks, args.ctx)
    llm.close()
    res = {}
    for name, path in paths.items():
        out = work / "results" / f"{name}.json"
        if not out.is_file():
            rec = measure(path, windows, args)
            out.write_text(json.dumps(rec))
            print(
                f"{name}: ppl {math.exp(np.mean(rec['nll'])):.3f}, "
                f"{rec['file_bytes'] / 2**20:.1f} MiB, decode {rec['decode_tps']:.1f} "
                f"tok/s, eval {rec['eval_s']:.0f}s, load {rec['load'][0]:.2f}",
                flush=True,
            )
        res[name] = json.loads(out.read_text())
    text = table(res, args.ctx)
    (work / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
