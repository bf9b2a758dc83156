"""``microscale eval``: perplexity of a (packed) model on held-out text.

    microscale eval --model out/x-nvfp4                      # stdlib val split
    microscale eval --model runs/x --formats nvfp4 --json    # quantized in memory
    microscale eval --model out/x --data my.txt --seq-len 128 --batches 4 --stats

``--model``: an exported folder or a training run (whose own corpus and sequence length
are then the defaults). ``--data``: ``stdlib``, ``stdlib-docs``, a text file / folder,
JSONL or a pre-tokenized ``.bin`` (its held-out split, as in training). ``--json`` prints
one JSON object: ``ppl``, ``nll`` (nats/token), ``tokens``, ``model``, ``data`` and
``memory`` (the resident-bytes accounting of ``--stats``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from microscale.cli.args import add_model_option, positive_int, required_group


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_option(
        required_group(parser),
        help="an exported model folder (packed layers stay packed) or a training run folder",
    )
    parser.add_argument("--data", "-d", help="corpus (default: the run's corpus, or stdlib)")
    parser.add_argument(
        "--split",
        default="val",
        choices=["val", "train"],
        help="the corpus's held-out (val, default) or training split",
    )
    parser.add_argument(
        "--seq-len",
        type=positive_int,
        help="tokens per sequence (default: the run's seq_len, or min(max_seq_len, 256))",
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=8, help="sequences per batch (default: 8)"
    )
    parser.add_argument(
        "--batches", type=positive_int, default=16, help="at most this many batches"
    )
    parser.add_argument(
        "--formats",
        help="quantize a run's weights in memory: a format name or JSON {layer path: format}",
    )
    parser.add_argument(
        "--activations",
        action="store_true",
        help="emulate W4A4: quantize each packed layer's inputs too",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--stats", action="store_true", help="print resident weight bytes")


def run(args: argparse.Namespace) -> int:
    from microscale.cli.export import parse_formats
    from microscale.export import CheckpointError
    from microscale.inference import evaluate_ppl, is_run_dir, load_model
    from microscale.inference.evaldata import eval_batches

    try:
        model = load_model(
            args.model, formats=parse_formats(args.formats), activations=args.activations or None
        )
        data, seq_len = args.data, args.seq_len
        if is_run_dir(args.model):
            from microscale.config import load_yaml
            from microscale.train import TrainConfig

            tcfg = load_yaml(TrainConfig, f"{args.model}/config.yaml")
            data = data or tcfg.data.corpus
            seq_len = seq_len or tcfg.data.seq_len
        data = data or "stdlib"
        seq_len = seq_len or min(model.config.max_seq_len, 256)
        batches = eval_batches(
            data,
            model.tokenizer,
            seq_len=seq_len,
            batch_size=args.batch_size,
            max_batches=args.batches,
            split=args.split,
            vocab_size=model.config.vocab_size,
        )
        res = evaluate_ppl(model, batches)
    except (ValueError, TypeError, FileNotFoundError, CheckpointError) as e:
        print(f"microscale eval: error: {e}", file=sys.stderr)
        return 2
    if not (math.isfinite(res["nll"]) and math.isfinite(res["ppl"])):
        print(
            f"microscale eval: error: {args.model} on {data}: the result is not finite "
            f"(nll {res['nll']}, ppl {res['ppl']}); the model's weights or the data are "
            "damaged or the model has diverged",
            file=sys.stderr,
        )
        return 1
    mem = model.memory_stats()
    if args.json:
        print(
            json.dumps(
                {
                    **res,
                    "model": str(args.model),
                    "data": data,
                    "split": args.split,
                    "seq_len": seq_len,
                    "memory": mem.to_dict(),
                }
            )
        )
        return 0
    print(
        f"{args.model} on {data} ({args.split}): ppl {res['ppl']:.4f}, "
        f"{res['nll']:.4f} nats/token over {res['tokens']} tokens"
    )
    if args.stats:
        print(f"[stats] {mem.summary()}")
    return 0
