"""``microscale generate``: continue a prompt with a (packed) model.

    microscale generate --model out/x-nvfp4 --prompt "def main(" --max-new-tokens 64
    microscale generate --model runs/x --prompt "import " --temperature 0.8 --top-p 0.95 --seed 1
    microscale generate --model runs/x --formats nvfp4 --prompt "class " --stats

``--model`` is an exported HF-style folder (packed layers stay packed) or a training run
(float weights; ``--formats`` quantizes them in memory). Greedy by default; sampling with
``--temperature`` > 0, ``--top-k``, ``--top-p`` and ``--seed``. Generation stops at the
tokenizer's end-of-text token (``--no-stop`` to ignore it) or after ``--max-new-tokens``.
``--stats`` prints the resident bytes of the packed layers against BF16 and the speed.
"""

from __future__ import annotations

import argparse
import sys
import time

from microscale.cli.args import (
    add_model_option,
    nonnegative_float,
    nonnegative_int,
    positive_int,
    probability,
    required_group,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    required = required_group(parser)
    add_model_option(
        required,
        help="an exported model folder (packed layers stay packed) or a training run folder",
    )
    required.add_argument(
        "--prompt",
        "-p",
        required=True,
        action="append",
        help="prompt text (repeat for a batch of prompts)",
    )
    parser.add_argument(
        "--max-new-tokens",
        "-n",
        type=positive_int,
        default=64,
        help="tokens to generate per prompt, at most (default: 64)",
    )
    parser.add_argument(
        "--temperature", "-t", type=nonnegative_float, default=0.0, help="0 = greedy (default)"
    )
    parser.add_argument("--top-k", type=nonnegative_int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=probability, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=nonnegative_int, default=0, help="sampling seed")
    parser.add_argument("--no-stop", action="store_true", help="do not stop at end-of-text")
    parser.add_argument(
        "--formats",
        help="quantize a run's weights in memory: a format name or JSON {layer path: format}",
    )
    parser.add_argument(
        "--activations",
        action="store_true",
        help="emulate W4A4: quantize each packed layer's inputs too",
    )
    parser.add_argument("--stats", action="store_true", help="print memory and speed")


def run(args: argparse.Namespace) -> int:
    import jax

    from microscale.cli.export import parse_formats
    from microscale.export import CheckpointError
    from microscale.inference import GenerationConfig, load_model

    try:
        for p in args.prompt:
            try:
                p.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"--prompt {p!r} is not valid UTF-8 text (undecodable byte "
                    f"at character {e.start})"
                ) from None
        model = load_model(
            args.model, formats=parse_formats(args.formats), activations=args.activations or None
        )
        tok = model.tokenizer
        if tok is None:
            raise ValueError(
                f"{args.model}: no tokenizer.json next to the model; cannot encode a text prompt"
            )
        stops = () if args.no_stop else (tok.eos_id,)
        gen = GenerationConfig(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            stop_tokens=stops,
        )
        prompts = [tok.encode(p) or [tok.eos_id] for p in args.prompt]
        t0 = time.perf_counter()
        res = model.generate(prompts, gen, key=jax.random.key(args.seed))
        dt = time.perf_counter() - t0
    except (ValueError, TypeError, FileNotFoundError, CheckpointError) as e:
        print(f"microscale generate: error: {e}", file=sys.stderr)
        return 2
    for text, row in zip(args.prompt, res.rows(), strict=True):
        print(text + tok.decode(row))
    if args.stats:
        n = int(res.lengths.sum())
        print(f"[stats] {model.memory_stats().summary()}")
        print(
            f"[stats] generated {n} tokens in {dt:.2f} s ({n / dt:.1f} tokens/s, "
            "compilation included)"
        )
    return 0
