"""``microscale export``: write a packed checkpoint vLLM / TensorRT-LLM load.

    microscale export --checkpoint runs/x --format compressed-tensors --out out/x-nvfp4
    microscale export --checkpoint runs/x --format modelopt --out out/x --rules runs/x/precision_rules.json
    microscale export --checkpoint runs/x --out out/x --formats ptq/layers.json     # {path: format}
    microscale export --checkpoint runs/x --out out/x --activations --calib-batches 8   # W4A4
    microscale export --checkpoint hf-llama/ --out out/llama-nvfp4   # any HF Llama folder
    microscale export --checkpoint runs/x --format gguf --out x.gguf  # llama.cpp (one file)
    microscale export --checkpoint out/q --format gguf --out q.gguf   # a quantize output

``--checkpoint`` is a training run folder (latest checkpoint, or ``--step``) or an HF-style
folder (plain or already packed: converted between layouts byte for byte when no formats
are given). Layers get NVFP4 unless ``--formats`` (a format name, or a JSON object / file
``{layer path: format}``, optionally under a ``"layers"`` key) or ``--rules`` (a
PrecisionRules JSON: each layer's recipe's forward formats) say otherwise; a run trained
with an allocation (``rules=``, e.g. QAT on a ``microscale quantize`` output, or
``bf16_policy=sensitivity``) exports its own ``precision_rules.json`` by default.
``--activations`` also quantizes layer inputs (W4A4 / W8A8) with static scales calibrated
on ``--calib-batches`` batches of held-out data (the run's corpus or ``--data``).
``--format gguf`` writes one llama.cpp file (:mod:`microscale.export.gguf`): NVFP4, MXFP4
and Q8_0 layers natively, FP8 / MXFP8 layers as Q8_0, bf16 layers as ``--dtype``. From a
packed folder or a ``microscale quantize`` output (its ``checkpoint/``) each layer keeps
its format, and NVFP4 / MXFP4 layers their bytes.
Exit codes: 0 done, 2 bad arguments or inconsistent inputs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from microscale.cli.args import nonnegative_int, positive_float, positive_int, refuse_unused

CALIB_BATCHES = 8  # --calib-batches default
SHARD_GB = 5.0  # --shard-size default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", "-c", required=True,
                        help="training run folder or HF-style model folder")
    parser.add_argument("--out", "-o", required=True,
                        help="output folder (--format gguf: output file)")
    parser.add_argument("--format", dest="layout", default="compressed-tensors",
                        choices=["compressed-tensors", "modelopt", "gguf"],
                        help="deployment layout (default: compressed-tensors; gguf: llama.cpp)")
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--formats", help="format name for every layer (nvfp4, fp8_e4m3, mxfp4, "
                   "mxfp8, q8_0, bf16) or JSON {layer path: format} (text or file)")
    g.add_argument("--rules", help="PrecisionRules JSON file (e.g. RUN/precision_rules.json)")
    parser.add_argument("--activations", action="store_true",
                        help="quantize layer inputs too (W4A4 / W8A8, calibrated static scales)")
    parser.add_argument("--calib-batches", type=positive_int, default=None,
                        help=f"calibration batches for --activations (default: {CALIB_BATCHES})")
    parser.add_argument("--data", help="calibration corpus for --activations (default: the run's "
                        "corpus)")
    parser.add_argument("--step", type=nonnegative_int,
                        help="run checkpoint step (default: latest)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="dtype of unquantized tensors (default: bfloat16)")
    parser.add_argument("--shard-size", type=positive_float, default=None,
                        help=f"shard the weights above this many GB (default: {SHARD_GB:g}; not with "
                             "--format gguf)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT")


def parse_formats(text: str | None):
    """A format name, or a {path: format} mapping from JSON text or a JSON file."""
    if text is None:
        return None
    where = f"--formats {text!r}"
    if not text.lstrip().startswith("{"):
        p = Path(text)
        if p.suffix != ".json" and not p.is_file():
            from microscale.formats import get_format

            return get_format(text.strip()).name  # a format name (validated early)
        from microscale.files import read_json

        obj = read_json(p, what="--formats file")
    else:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON: {e.msg} at column {e.colno}; "
                             "expected a format name or {layer path: format}") from None
    if isinstance(obj, dict) and isinstance(obj.get("layers"), dict):
        obj = obj["layers"]
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: the JSON must be an object {{layer path: format}}, got "
                         f"a {type(obj).__name__}")
    return obj


def quantize_output_checkpoint(src: Path) -> Path:
    """A ``microscale quantize`` output folder -> its packed ``checkpoint/``; else ``src``."""
    if not ((src / "report.json").is_file() and (src / "precision_rules.json").is_file()):
        return src
    if (src / "checkpoint" / "config.json").is_file():
        return src / "checkpoint"
    if (src / "model.gguf").is_file():
        raise ValueError(f"--checkpoint {str(src)!r} is a quantize output that already holds "
                         f"its GGUF: {str(src / 'model.gguf')!r}")
    raise FileNotFoundError(f"--checkpoint {str(src)!r}: a quantize output without an HF-style "
                            "checkpoint/ (quantized with --layout microscale?)")


def _print_written(res, layout: str, config, dtype: str) -> None:
    """One line: the file or folder written, its layout and size, layers per format, and
    the bits per weight of the linear layers and of the whole model."""
    from microscale.export.hf import param_shapes
    from microscale.ptq.search import model_bits

    counts: dict[str, int] = {}
    for v in res.layers.values():
        counts[v] = counts.get(v, 0) + 1
    shapes = param_shapes(config)
    numel = {p: math.prod(shapes[f"{p}.kernel"]) for p in res.layers}
    bits = model_bits({p: f.split("/")[0] for p, f in res.layers.items()}, numel,
                      config.num_params() - sum(numel.values()),
                      other_bits=32 if dtype == "float32" else 16)
    print(f"wrote {res.path} ({layout}, {res.tensor_bytes / 2**20:.2f} MiB of tensors): "
          + ", ".join(f"{n} x {k}" for k, n in sorted(counts.items()))
          + f"; {bits['linear_bits']:.3f} bits per weight in the linear layers, "
          f"{bits['model_bits']:.3f} in the whole model")


def _write_gguf(model, args, config, formats, tokenizer) -> int:
    from microscale.export.gguf import write_gguf

    res = write_gguf(model, args.out, config=config, layer_formats=formats,
                     tokenizer=tokenizer, dtype=args.dtype, overwrite=args.overwrite)
    _print_written(res, "gguf", config, args.dtype)
    return 0


def run(args: argparse.Namespace) -> int:
    from microscale.export.writer import check_export_out
    from microscale.files import check_output_file, lock_folder

    try:
        if args.layout == "gguf":
            check_output_file(args.out, what="--out", overwrite=args.overwrite)
        else:
            check_export_out(args.out, overwrite=args.overwrite)
        lock = lock_folder(args.out).acquire()  # before any work; held until the end
    except (OSError, ValueError) as e:
        print(f"microscale export: error: {e}", file=sys.stderr)
        return 2
    try:
        return _run(args)
    finally:
        lock.release()


def _run(args: argparse.Namespace) -> int:
    from microscale.export import (
        Checkpoint,
        CheckpointError,
        export_checkpoint,
        read_checkpoint,
    )
    from microscale.files import check_input_dir
    from microscale.inference import InferenceModel, is_run_dir
    from microscale.model import PrecisionRules

    try:
        formats = parse_formats(args.formats)
        if args.rules:
            formats = PrecisionRules.load(args.rules)
        src = check_input_dir(args.checkpoint, what="--checkpoint", expected="a training run "
                              "folder, a quantize output or an HF model folder")
        gguf = args.layout == "gguf"
        if gguf and args.activations:
            raise ValueError("--activations: GGUF stores weights only (llama.cpp quantizes "
                             "activations itself); drop --activations")
        refuse_unused(
            (gguf and args.shard_size is not None, "--shard-size",
             "with --format gguf (it writes one file)"),
            (not args.activations and args.calib_batches is not None, "--calib-batches",
             "without --activations (only layer inputs are calibrated)"),
            (not args.activations and args.data is not None, "--data",
             "without --activations (only layer inputs are calibrated)"))
        src = quantize_output_checkpoint(src)
        tokenizer, data, seq_len = None, args.data, 128
        tok_file = src / "tokenizer.json"
        if gguf and tok_file.is_file():
            from microscale.export.gguf import gguf_vocab

            gguf_vocab(tok_file)  # an unsupported tokenizer: refused before the model is read
        if is_run_dir(src):
            from microscale.data import load_tokenizer
            from microscale.train import load_checkpoint

            model, tcfg, _ = load_checkpoint(src, args.step)
            config = tcfg.model
            if formats is None and tcfg.own_allocation:
                # a run trained with an allocation (QAT, sensitivity-chosen bf16 layers)
                # exports that allocation
                formats = PrecisionRules.load(src / "precision_rules.json")
            if (src / "tokenizer.json").is_file():
                tokenizer = load_tokenizer(src / "tokenizer.json")
            data, seq_len = data or tcfg.data.corpus, tcfg.data.seq_len
        elif (src / "config.json").is_file():
            # A packed folder without --formats is re-written as is (layout conversion keeps
            # its bytes); otherwise its weights are decoded and quantized again (with
            # --activations, export_checkpoint keeps the folder's weight formats).
            ck = read_checkpoint(src, dequantize=not gguf and (formats is not None
                                                                 or args.activations))
            if formats is None and ck.layout == "hf":
                formats = "nvfp4"
            model, config, tokenizer = ck, ck.config, ck.tokenizer()
            seq_len = min(config.max_seq_len, 256)
        else:
            raise FileNotFoundError(f"--checkpoint {str(src)!r}: neither a training run "
                                    "(config.yaml + checkpoints/) nor an HF model folder")
        if gguf:  # the file brings its tokenizer_config.json (special tokens, chat template)
            return _write_gguf(model, args, config, formats,
                               tok_file if tok_file.is_file() else tokenizer)
        input_amax = None
        if args.activations:
            from microscale.inference.evaldata import eval_batches
            from microscale.inference.model import collect_input_amax

            if data is None:
                raise ValueError("--activations needs calibration data: pass --data")
            dense = InferenceModel.from_params(
                model.params if isinstance(model, Checkpoint) else model, config)
            batches = eval_batches(data, tokenizer, seq_len=seq_len, batch_size=8,
                                   max_batches=args.calib_batches or CALIB_BATCHES,
                                   vocab_size=config.vocab_size)
            input_amax = collect_input_amax(dense, batches)
        res = export_checkpoint(model, args.out, config=config, layout=args.layout,
                                layer_formats=formats, activations=args.activations,
                                input_amax=input_amax, dtype=args.dtype,
                                tokenizer=tok_file if tok_file.is_file() else tokenizer,
                                shard_bytes=int((args.shard_size or SHARD_GB) * 1e9),
                                overwrite=args.overwrite)
    except (ValueError, TypeError, OSError, ImportError, CheckpointError) as e:
        print(f"microscale export: error: {e}", file=sys.stderr)
        return 2
    _print_written(res, res.layout, config, args.dtype)
    return 0
