"""``microscale export``: write a packed checkpoint vLLM / TensorRT-LLM load.

    microscale export -m runs/x -o out/x-nvfp4 layout=compressed-tensors
    microscale export -m runs/x -o out/x layout=modelopt rules=runs/x/precision_rules.json
    microscale export -m runs/x -o out/x formats=ptq/layers.json       # {path: format}
    microscale export -m runs/x -o out/x activations=true calib_batches=8   # W4A4
    microscale export -m hf-llama/ -o out/llama-nvfp4   # any HF folder of a supported family
    microscale export -m runs/x -o x.gguf layout=gguf   # llama.cpp (one file)
    microscale export -m out/q -o q.gguf layout=gguf    # a quantize output
    microscale export --list-keys                       # every key with its value and meaning

``--model`` is a training run folder (latest checkpoint, or ``step=``) or an HF-style
folder (plain or already packed: converted between layouts byte for byte when no formats
are given). The keys are those of :class:`~microscale.inference.export_run.ExportConfig`.
Layers get NVFP4 unless ``formats=`` (a format name, or a JSON object / file ``{layer
path: format}``, optionally under a ``"layers"`` key) or ``rules=`` (a PrecisionRules JSON:
each layer's recipe's forward formats) say otherwise; a run trained with an allocation
(``precision.kind=rules``, e.g. QAT on a ``microscale quantize`` output, or
``precision.kind=sensitivity``)
exports its own ``precision_rules.json`` by default. ``activations=true`` also quantizes
layer inputs (W4A4 / W8A8) with static scales calibrated on ``calib_batches`` batches of
held-out data (the run's corpus or ``corpus=``). ``layout=gguf`` writes one llama.cpp file
(:mod:`microscale.export.gguf`): NVFP4, MXFP4 and Q8_0 layers natively, FP8 / MXFP8 layers
as Q8_0, bf16 layers as ``dtype``. From a packed folder or a ``microscale quantize``
output (its ``checkpoint/``) each layer keeps its format, and NVFP4 / MXFP4 layers their
bytes. The flags before ``key=value`` (``--format gguf``, ``--data``, ``--activations``,
...) are gone: each is refused with one line naming its key (:data:`REMOVED_FLAGS`), and so
are ``--checkpoint`` / ``-c``, now ``--model`` / ``-m`` as in every command that reads a model.
Exit codes: 0 done, 2 bad arguments or inconsistent inputs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from microscale.cli.args import (
    add_model_option,
    add_quiet,
    add_removed_flags,
    hf_families,
    refuse_unused,
    require,
    required_group,
    spelled,
    split_keys,
)

# The flags before key=value (removed; docs/release-notes.md) -> what replaces each.
REMOVED_FLAGS = {
    "--format": "layout=NAME",
    "--formats": "formats=NAME|JSON",
    "--rules": "rules=PATH",
    "--activations": "activations=true",
    "--calib-batches": "calib_batches=N",
    "--data": "corpus=PATH",
    "--step": "step=N",
    "--dtype": "dtype=NAME",
    "--embed-format": "embed_format=NAME",
    "--shard-size": "shard_size=GB",
    "--overwrite": "overwrite=true",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    required = required_group(parser, unless="--list-keys")
    add_model_option(
        required,
        required=False,
        renamed=("--checkpoint", "-c"),
        help="a training run folder, a quantize output or an HF-style model folder "
        f"(one of: {hf_families()}; plain or packed)",
    )
    required.add_argument("--out", "-o", help="output folder (layout=gguf: output file)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="ExportConfig keys: layout=gguf formats=nvfp4 activations=true "
        "corpus=texts/ (--list-keys)",
    )
    add_quiet(parser)
    add_removed_flags(parser, REMOVED_FLAGS)


def export_config(args: argparse.Namespace):
    """The :class:`ExportConfig` of the command line's ``key=value`` overrides."""
    from microscale.config import apply_overrides
    from microscale.inference.export_run import ExportConfig

    (keys,) = split_keys(args.overrides, ExportConfig)
    return apply_overrides(ExportConfig(), keys)


def configs(args: argparse.Namespace):
    """The configs the ``key=value`` settings build (``--list-keys`` lists their keys)."""
    return (export_config(args),)


def parse_formats(text: str | None):
    """A format name, or a {path: format} mapping from JSON text or a JSON file."""
    if text is None:
        return None
    where = f"formats={text!r}"
    if not text.lstrip().startswith("{"):
        p = Path(text)
        if p.suffix != ".json" and not p.is_file():
            from microscale.formats import get_format

            return get_format(text.strip()).name  # a format name (validated early)
        from microscale.files import read_json

        obj = read_json(p, what="formats= file")
    else:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{where} is not valid JSON: {e.msg} at column {e.colno}; "
                "expected a format name or {layer path: format}"
            ) from None
    if isinstance(obj, dict) and isinstance(obj.get("layers"), dict):
        obj = obj["layers"]
    if not isinstance(obj, dict):
        raise ValueError(
            f"{where}: the JSON must be an object {{layer path: format}}, got "
            f"a {type(obj).__name__}"
        )
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
    bits = model_bits(
        {p: f.split("/")[0] for p, f in res.layers.items()},
        numel,
        config.num_params() - sum(numel.values()),
        other_bits=32 if dtype == "float32" else 16,
    )
    print(
        f"wrote {res.path} ({res.layout}, {res.tensor_bytes / 2**20:.2f} MiB of tensors): "
        + ", ".join(f"{n} x {k}" for k, n in sorted(counts.items()))
        + f"; {bits['linear_bits']:.3f} bits per weight in the linear layers, "
        f"{bits['model_bits']:.3f} in the whole model"
    )


def run(args: argparse.Namespace) -> int:
    """Parse the command line, then :func:`~microscale.inference.export_run.export_run`."""
    from microscale.export import CheckpointError
    from microscale.export.registry import get_layout
    from microscale.inference.export_run import export_run
    from microscale.model import PrecisionRules

    try:
        cfg = export_config(args)
    except ValueError as e:  # a ConfigError
        print(f"microscale export: error: {e}", file=sys.stderr)
        return 2
    if not require(args, "export", "model", "out"):
        return 2
    try:
        formats = parse_formats(cfg.formats)
        if cfg.rules:
            formats = PrecisionRules.load(cfg.rules)
        layout = get_layout(cfg.layout)
        if cfg.activations:
            layout.refuse_activations()
        refuse_unused(
            (
                layout.single_file and cfg.shard_size is not None,
                spelled("shard_size", cfg.shard_size),
                f"with layout={layout.name} (it writes one file)",
            ),
            (
                not cfg.activations and cfg.calib_batches is not None,
                spelled("calib_batches", cfg.calib_batches),
                "without activations=true (only layer inputs are calibrated)",
            ),
            (
                not cfg.activations and cfg.corpus is not None,
                spelled("corpus", cfg.corpus),
                "without activations=true (only layer inputs are calibrated)",
            ),
        )
        res = export_run(
            args.model,
            args.out,
            layout=layout.name,
            formats=formats,
            activations=cfg.activations,
            calib_batches=cfg.calib_batches,
            data=cfg.corpus,
            step=cfg.step,
            dtype=cfg.dtype,
            shard_bytes=None if cfg.shard_size is None else int(cfg.shard_size * 1e9),
            embed_format=cfg.embed_format,
            overwrite=cfg.overwrite,
        )
    except (ValueError, TypeError, OSError, ImportError, CheckpointError) as e:
        print(f"microscale export: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        _print_written(res, cfg.dtype)
    return 0
