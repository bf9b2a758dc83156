"""``import_hf(HF_FOLDER, RUN)``: an HF model folder as a microscale run folder, no training.

The run folder has the layout a training run writes, so every command that reads a run
(``train init_from=``, ``eval``, ``generate``, ``quantize``, ``export``, ``verify``) reads
it::

    config.yaml            TrainConfig: the model from config.json, data.tokenizer = this
                           folder's tokenizer.json, init_from = HF_FOLDER (provenance)
    precision_rules.json   the bf16 recipe's rules
    tokenizer.json         the folder's own file, byte for byte (plus tokenizer_config.json,
                           special_tokens_map.json, generation_config.json and
                           chat_template.jinja when present)
    checkpoints/0/         float32 master weights (the HF tensors, exactly: bf16, fp16 and
                           fp32 values are all float32 values) and a fresh AdamW state
    summary.json           status "imported", the source and the parameter count

What is read and refused (before any weight is read): ``config.json`` through
:func:`microscale.export.model_config_from_hf` (every shape, ``rope_theta``, RoPE
scaling -- ``rope_scaling`` / ``rope_parameters`` of kind default, linear, dynamic,
llama3 or yarn --, ``rms_norm_eps``, ``tie_word_embeddings``, ``max_position_embeddings``,
``head_dim``, the family -- a row of :data:`microscale.model.FAMILIES` (Llama, Mistral
and its sliding window, Qwen2, Qwen3, Gemma 3 and its local layers) --; another
``model_type``, biases the family lacks, other RoPE kinds, another activation, sliding
windows where the family has none are refused naming the key); ``tokenizer.json`` must
exist and fit the embedding
(:func:`microscale.data.check_vocab_fits`). A folder of packed weights
(compressed-tensors, ModelOpt) is imported dequantized. The run folder appears whole or
not at all (:func:`microscale.files.atomic_folder`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from microscale import __version__
from microscale.config import dump_yaml, to_dict
from microscale.files import (
    atomic_folder,
    atomic_write_json,
    check_input_dir,
    check_output_dir,
    lock_folder,
    read_json,
)
from microscale.outputs import ExportFolder, TrainingRun

__all__ = ["import_hf"]

_SEQ_LEN = 256  # data.seq_len of the run (at most the model's context)


def expected_folder() -> str:
    """What ``import`` reads, for its errors: the families from the registry
    (:data:`microscale.model.FAMILIES`), and that it reads a local folder only."""
    from microscale.model.family import FAMILIES

    return (
        f"an HF model folder (one of: {', '.join(FAMILIES)}; config.json, *.safetensors, "
        "tokenizer.json) on this machine; nothing is downloaded from the Hub (download it "
        "first, e.g. huggingface-cli download ID --local-dir DIR)"
    )


def import_hf(
    folder: str | os.PathLike, out: str | os.PathLike, *, say: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Write run folder ``out`` holding HF folder ``folder``'s model; returns the summary
    (also ``out/summary.json``). ``out`` must not exist."""
    from microscale.data import DataConfig, check_vocab_fits, load_tokenizer
    from microscale.export.hf import model_config_from_hf
    from microscale.export.reader import hf_head_config
    from microscale.export.tokenizer import TOKENIZER_FILES
    from microscale.train.config import TrainConfig

    src = check_input_dir(folder, what="", expected=expected_folder())
    if not (src / ExportFolder.CONFIG).is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no config.json; expected {expected_folder()}")
    out = check_output_dir(out, what="--out").absolute()
    if out.exists():
        raise FileExistsError(f"--out {str(out)!r} already exists; choose a new folder")
    try:
        model = model_config_from_hf(read_json(src / ExportFolder.CONFIG, what=ExportFolder.CONFIG))
    except ValueError as e:
        # its messages name config.json's keys as "config.json: key=value: ..."
        raise ValueError(
            f"{src / ExportFolder.CONFIG}: {str(e).removeprefix(ExportFolder.CONFIG + ': ')}"
        ) from None
    model = hf_head_config(src, model)  # a tied config.json beside a head of its own
    if not (src / ExportFolder.TOKENIZER).is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} has no tokenizer.json; a run needs the model's own tokenizer"
        )
    tok = load_tokenizer(src / ExportFolder.TOKENIZER)
    check_vocab_fits(
        tok.vocab_size,
        model.vocab_size,
        what=f"the tokenizer {str(src / ExportFolder.TOKENIZER)!r}",
    )
    cfg = TrainConfig(
        model=model,
        data=DataConfig(
            tokenizer=str(out / TrainingRun.TOKENIZER), seq_len=min(_SEQ_LEN, model.max_seq_len)
        ),
        init_from=str(src.absolute()),
        out=str(out),
    )
    say = say or (lambda _: None)
    with lock_folder(out), atomic_folder(out) as tmp:
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        dump_yaml(cfg, tmp / TrainingRun.CONFIG)
        cfg.precision_rules().save(tmp / TrainingRun.RULES)
        say(f"import: reading the weights of {src}")
        init = _save_step0(cfg, src, tmp / TrainingRun.CHECKPOINTS)
        summary = {
            "status": "imported",
            "steps": 0,
            "tokens": 0,
            "params": model.num_params(),
            "init_from": init.to_dict(),
            "out": str(out),
            "config": to_dict(cfg),
            "microscale_version": __version__,
        }
        atomic_write_json(tmp / TrainingRun.SUMMARY, summary)
    say(f"import: {model.num_params():,} parameters ({init.note}) -> {out}")
    return summary


def _save_step0(cfg, src: Path, directory: Path):
    """Checkpoint step 0 of ``cfg``: ``src``'s weights and a fresh optimizer state."""
    from microscale.train.checkpoint import Checkpointer
    from microscale.train.init import load_init_weights
    from microscale.train.loop import _init_params
    from microscale.train.state import build_state

    weights, init = load_init_weights(src.absolute())
    st = build_state(cfg, abstract=True)
    params = _init_params(cfg, st, weights, init)
    del weights
    opt_state = jax.jit(st.tx.init, out_shardings=st.opt_shardings)(params)
    meta = {
        "step": 0,
        "data_step": 0,
        "tokens": 0,
        "nonfinite_total": 0,
        "nonfinite_streak": 0,
        "phase": "main",
        "train_time_s": 0.0,
        "recipe": cfg.recipe,
        "microscale_version": __version__,
        "init_from": init.to_dict(),
        "bf16_allocation": None,
        "config": to_dict(cfg),
    }
    with Checkpointer(directory, async_save=False) as ck:
        ck.save(0, {"params": params, "opt_state": opt_state}, meta)
    return init
