"""``microscale import``: an HF model folder as a microscale run folder, without training.

    microscale import --model path/to/SmolLM2-135M --out runs/smollm2
    microscale eval -m runs/smollm2                      # any command that reads a run
    microscale train init_from=runs/smollm2 steps=100 out=runs/ft   # the model from the run

The model comes from ``config.json`` (every shape, rope_theta, RoPE scaling -- Llama
3.x's llama3, linear, dynamic, yarn --, rms_norm_eps, tied embeddings, vocabulary), the tokenizer is the folder's ``tokenizer.json``, and the weights
equal the HF tensors bit for bit (:mod:`microscale.train.hfimport`).
The folder was a positional argument (``HF_FOLDER``) before; it is ``--model`` / ``-m`` as in
every command that reads a model, and a positional folder is refused with one line naming it.
Exit codes: 0 written, 2 bad arguments or a folder that cannot be imported (nothing
written).
"""

from __future__ import annotations

import argparse
import sys

from microscale.cli.args import add_model_option, add_quiet, hf_families, require, required_group


def add_arguments(parser: argparse.ArgumentParser) -> None:
    required = required_group(parser)
    add_model_option(
        required,
        required=False,  # checked in run(): the old positional HF_FOLDER names --model
        renamed=("HF_FOLDER",),
        help=f"an HF model folder (one of: {hf_families()}): config.json, *.safetensors, "
        "tokenizer.json; a local folder (nothing is downloaded from the Hub)",
    )
    required.add_argument("--out", "-o", required=True, help="the run folder to write (new)")
    add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    from microscale.train.hfimport import import_hf

    if not require(args, "import", "model"):
        return 2
    say = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    import_hf(args.model, args.out, say=say)
    return 0
