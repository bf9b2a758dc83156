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
with an allocation (``precision.kind=rules``, e.g. QAT on a ``microscale quantize`` output, or
``precision.kind=sensitivity``) exports its own ``precision_rules.json`` by default.
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from microscale.export.registry import layout_names
    from microscale.export.writer import DEFAULT_SHARD_BYTES
    from microscale.inference.export_run import CALIB_BATCHES

    parser.add_argument("--checkpoint", "-c", required=True,
                        help="training run folder or HF-style model folder")
    parser.add_argument("--out", "-o", required=True,
                        help="output folder (--format gguf: output file)")
    parser.add_argument("--format", dest="layout", default="compressed-tensors",
                        choices=layout_names(writes_model=True),
                        help="deployment layout (default: compressed-tensors; hf: float "
                             "weights; gguf: llama.cpp)")
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
    parser.add_argument("--embed-format", default=None,
                        help="GGUF only: the token embedding / tied LM head's format (bf16, "
                             "q8_0, mxfp4; default: unquantized, as --dtype)")
    parser.add_argument("--shard-size", type=positive_float, default=None,
                        help=f"shard the weights above this many GB (default: "
                             f"{DEFAULT_SHARD_BYTES / 1e9:g}; not with --format gguf)")
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


def _print_written(res, dtype: str) -> None:
    """One line: the file or folder written, its layout and size, layers per format, and
    the bits per weight of the linear layers and of the whole model."""
    from microscale.export.hf import param_shapes
    from microscale.ptq.search import model_bits

    counts: dict[str, int] = {}
    for v in res.layers.values():
        counts[v] = counts.get(v, 0) + 1
    config = res.config
    shapes = param_shapes(config)
    numel = {p: math.prod(shapes[f"{p}.kernel"]) for p in res.layers}
    bits = model_bits({p: f.split("/")[0] for p, f in res.layers.items()}, numel,
                      config.num_params() - sum(numel.values()),
                      other_bits=32 if dtype == "float32" else 16)
    print(f"wrote {res.path} ({res.layout}, {res.tensor_bytes / 2**20:.2f} MiB of tensors): "
          + ", ".join(f"{n} x {k}" for k, n in sorted(counts.items()))
          + f"; {bits['linear_bits']:.3f} bits per weight in the linear layers, "
          f"{bits['model_bits']:.3f} in the whole model")


def run(args: argparse.Namespace) -> int:
    """Parse the flags, then :func:`~microscale.inference.export_run.export_run`."""
    from microscale.export import CheckpointError
    from microscale.export.registry import get_layout
    from microscale.inference.export_run import export_run
    from microscale.model import PrecisionRules

    try:
        formats = parse_formats(args.formats)
        if args.rules:
            formats = PrecisionRules.load(args.rules)
        layout = get_layout(args.layout)
        if args.activations and not layout.input_scales:
            raise ValueError(f"--activations: the {layout.name} layout stores weights only; "
                             "drop --activations")
        refuse_unused(
            (layout.single_file and args.shard_size is not None, "--shard-size",
             f"with --format {layout.name} (it writes one file)"),
            (not args.activations and args.calib_batches is not None, "--calib-batches",
             "without --activations (only layer inputs are calibrated)"),
            (not args.activations and args.data is not None, "--data",
             "without --activations (only layer inputs are calibrated)"))
        res = export_run(args.checkpoint, args.out, layout=layout.name, formats=formats,
                         activations=args.activations, calib_batches=args.calib_batches,
                         data=args.data, step=args.step, dtype=args.dtype,
                         shard_bytes=None if args.shard_size is None
                         else int(args.shard_size * 1e9),
                         embed_format=args.embed_format, overwrite=args.overwrite)
    except (ValueError, TypeError, OSError, ImportError, CheckpointError) as e:
        print(f"microscale export: error: {e}", file=sys.stderr)
        return 2
    _print_written(res, args.dtype)
    return 0
