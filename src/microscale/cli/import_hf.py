"""``microscale import``: an HF model folder as a microscale run folder, without training.

    microscale import path/to/SmolLM2-135M --out runs/smollm2
    microscale eval -m runs/smollm2                      # any command that reads a run
    microscale train init_from=runs/smollm2 steps=100 out=runs/ft   # the model from the run

The model comes from ``config.json`` (every shape, rope_theta, RoPE scaling -- Llama
3.x's llama3, linear, dynamic, yarn --, rms_norm_eps, tied embeddings, vocabulary), the tokenizer is the folder's ``tokenizer.json``, and the weights
equal the HF tensors bit for bit (:mod:`microscale.train.hfimport`).
Exit codes: 0 written, 2 bad arguments or a folder that cannot be imported (nothing
written).
"""

from __future__ import annotations

import argparse
import sys

from microscale.cli.args import add_quiet, hf_families, required_group


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "folder",
        metavar="HF_FOLDER",
        help=f"an HF model folder (one of: {hf_families()}): config.json, *.safetensors, "
        "tokenizer.json; a local folder (nothing is downloaded from the Hub)",
    )
    required_group(parser).add_argument(
        "--out", "-o", required=True, help="the run folder to write (new)"
    )
    add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    from microscale.train.hfimport import import_hf

    say = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    import_hf(args.folder, args.out, say=say)
    return 0
