"""RTN vs GPTQ on a real pretrained model: SmolLM2-135M-Instruct, uniform 4-bit weights.

Takes the HF folder ``benchmarks/smollm2_hf.py`` writes and measures the held-out
perplexity of the model with every linear layer's weights (210 layers; the tied token
embedding / LM head and the norms stay as they are) in NVFP4 or MXFP4:

* ``rtn``: round to nearest (the plain format quantizer);
* ``rtn+``: microscale's default PTQ choices (NVFP4: MSE tensor scale and four over six);
* ``gptq``: GPTQ error compensation (microscale.ptq.gptq) with the Hessians of every
  layer's input over the calibration sequences (one pass of the unquantized model);
* ``gptq+``: GPTQ on top of the MSE tensor scale and four over six (NVFP4).

Text: the Python standard library's sources (the project's stdlib corpus), tokenized with
the model's own tokenizer, documents joined by ``<|endoftext|>``; evaluation windows are
consecutive from the start, calibration windows drawn at random (seeded) from the tokens
after them (disjoint). Every configuration is evaluated on the same windows; the reported
differences are paired over evaluation chunks (one chunk = one batch of ``--rows``
windows): mean loss difference with its 95% Student-t interval over chunks
(``microscale.experiments.stats.mean_ci``), shown as a perplexity ratio.

The weights being quantized were themselves decoded from Q4_1: the reference ("bf16", the
dequantized model, bf16 GEMMs) already lies on a 4-bit grid, so the gaps here are those of
re-quantizing a Q4_1 model, not of quantizing the original bf16 SmolLM2.

Each configuration's per-chunk losses are saved in ``--out/<name>.json`` and reused, so the
run can be split across invocations (``--configs``) to keep each under a time limit.

Run:  python benchmarks/smollm2_ptq.py --hf /tmp/smollm2-hf --out /tmp/smollm2-ptq
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

CONFIGS = {  # name: (format, WeightPTQ keyword arguments)
    "bf16": ("bf16", {}),
    "nvfp4-rtn": ("nvfp4", {"mse_scale": False, "four_over_six": False}),
    "nvfp4-rtn+": ("nvfp4", {}),
    "nvfp4-gptq": ("nvfp4", {"mse_scale": False, "four_over_six": False, "method": "gptq"}),
    "nvfp4-gptq+": ("nvfp4", {"method": "gptq"}),
    "mxfp4-rtn": ("mxfp4", {"mse_scale": False, "four_over_six": False}),
    "mxfp4-gptq": ("mxfp4", {"mse_scale": False, "four_over_six": False, "method": "gptq"}),
}


def token_windows(
    tokenizer, n_eval: int, n_calib: int, seq_len: int, rows: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(eval ``[n_eval / rows, rows, seq + 1]`` consecutive, calibration ``[.., rows, seq + 1]``
    at random offsets after them) from the stdlib corpus."""
    from microscale.data.sources import stdlib_files
    from microscale.ptq import calibration_windows

    need = (n_eval + 4 * n_calib) * (seq_len + 1)
    ids: list[int] = []
    for _, text in stdlib_files():
        ids += tokenizer.encode(text) + [tokenizer.eos_id]
        if len(ids) >= need:
            break
    toks = np.asarray(ids, np.int32)
    w = seq_len + 1
    evals = np.stack([toks[i * w : (i + 1) * w] for i in range(n_eval)])
    calib = calibration_windows(
        toks, n_tokens=n_calib * seq_len, seq_len=seq_len, rows=rows, seed=seed, start=n_eval * w
    )
    if calib is None:
        raise ValueError("not enough stdlib tokens for the calibration windows")
    return evals.reshape(-1, rows, w), calib


def cached_hessians(eng, calib, path: Path) -> dict[str, np.ndarray]:
    """``eng.input_hessians(calib)``, saved to ``path`` (float32, one array per distinct
    input) and read back on the next invocation."""
    if path.is_file():
        with np.load(path) as z:
            owner = json.loads(str(z["owner"]))
            arrays = {k: z[k].astype(np.float64) for k in set(owner.values())}
        return {p: arrays[owner[p]] for p in eng.paths}
    hs = eng.input_hessians(calib)
    first: dict[int, str] = {}
    owner = {p: first.setdefault(id(h), p) for p, h in hs.items()}
    np.savez(
        path, owner=json.dumps(owner), **{p: hs[p].astype(np.float32) for p in set(owner.values())}
    )
    return hs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf", default="/tmp/smollm2-hf", help="HF folder (smollm2_hf.py)")
    ap.add_argument("--out", default="/tmp/smollm2-ptq", help="results folder")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    ap.add_argument("--eval-seqs", type=int, default=64)
    ap.add_argument("--calib-seqs", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--rows", type=int, default=2, help="windows per chunk (batch)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from microscale.export.reader import build_model, read_checkpoint
    from microscale.ptq import Engine, WeightPTQ
    from microscale.ptq.weights import WeightCache

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ck = read_checkpoint(args.hf)
    model = build_model(ck.config, ck.params)
    evals, calib = token_windows(
        ck.tokenizer(), args.eval_seqs, args.calib_seqs, args.seq_len, args.rows, args.seed
    )
    eng = Engine(model)
    setup = {
        "eval_tokens": int(evals.shape[0] * evals.shape[1] * args.seq_len),
        "calib_tokens": int(calib.shape[0] * calib.shape[1] * args.seq_len),
        "chunks": int(evals.shape[0]),
        "seq_len": args.seq_len,
        "rows": args.rows,
    }
    print(f"loaded in {time.perf_counter() - t0:.1f}s: {setup}", flush=True)
    hessians = None
    for name in args.configs.split(","):
        fmt, kw = CONFIGS[name]
        path = out / f"{name}.json"
        if path.is_file():
            continue
        t = time.perf_counter()
        ptq = WeightPTQ(**kw)
        if ptq.method == "gptq" and hessians is None:
            hessians = cached_hessians(eng, calib, out / "hessians.npz")
            print(
                f"hessians over {setup['calib_tokens']} tokens in {time.perf_counter() - t:.1f}s",
                flush=True,
            )
        weights = WeightCache(eng, {p: p for p in eng.paths}, hessians)
        qw = weights.for_assignment({p: fmt for p in eng.paths}, ptq)
        t_q = time.perf_counter() - t
        params = eng.with_kernels({p: w.values for p, w in qw.items()})
        losses = eng.batch_losses(params, evals)
        rec = {
            "name": name,
            "format": fmt,
            "ptq": kw,
            "losses": losses.tolist(),
            **setup,
            "quantize_s": t_q,
            "total_s": time.perf_counter() - t,
        }
        path.write_text(json.dumps(rec, indent=1))
        print(
            f"{name}: ppl {math.exp(losses.mean()):.4f} (quantize {t_q:.1f}s, total "
            f"{rec['total_s']:.1f}s)",
            flush=True,
        )
    summarize(out)
    return 0


def summarize(out: Path) -> None:
    """The markdown table of every saved configuration against bf16 and against RTN."""
    from microscale.experiments.stats import mean_ci

    recs = {
        p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.stem in CONFIGS
    }
    if "bf16" not in recs:
        return
    ref = np.asarray(recs["bf16"]["losses"])

    def ratio(d):
        ci = mean_ci(d.tolist())
        lo, hi = ci["ci95"]
        return (
            f"{100 * math.expm1(ci['mean']):+.2f}% "
            f"[{100 * math.expm1(lo):+.2f}, {100 * math.expm1(hi):+.2f}]"
        )

    lines = [
        f"{recs['bf16']['eval_tokens']} eval tokens in {len(ref)} chunks, "
        f"{recs['bf16']['calib_tokens']} calibration tokens",
        "",
        "| weights | ppl | vs bf16 (95% CI) | vs RTN (95% CI) | gap to bf16 recovered |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in CONFIGS:
        if name not in recs:
            continue
        x = np.asarray(recs[name]["losses"])
        base = f"{name.split('-')[0]}-rtn"
        vs_rtn, rec = "", ""
        if name != base and base in recs and name != "bf16":
            r = np.asarray(recs[base]["losses"])
            vs_rtn = ratio(x - r)
            gap = r.mean() - ref.mean()
            rec = f"{100 * (r.mean() - x.mean()) / gap:.0f}%" if gap > 0 else ""
        lines.append(
            f"| {name} | {math.exp(x.mean()):.4f} | "
            f"{ratio(x - ref) if name != 'bf16' else ''} | {vs_rtn} | {rec} |"
        )
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    raise SystemExit(main())
