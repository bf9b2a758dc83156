"""``init_from=PATH``: start a training run from another model's weights, and only the
weights (the optimizer, schedule and data position start fresh, unlike ``resume=true``).
``PATH`` is a microscale run folder (its master weights), a ``microscale quantize`` output
(its source run's master weights while that checkpoint exists, else its dequantized
``checkpoint/``) or an HF folder of a supported family (:func:`source_kind`); the weights
are checked against the run's model config before anything trains, and on the command
line (:func:`adopt_source_model`) the model is the source's. The rules and what is
recorded: docs/finetuning.md.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from microscale.config import ConfigError, apply_overrides, load_yaml, parse_overrides
from microscale.export import flat_params, read_checkpoint
from microscale.export.hf import _HF_KEYS, model_config_from_hf
from microscale.export.reader import hf_head_config
from microscale.export.registry import Layout, detect
from microscale.files import check_input_dir, read_json
from microscale.model import ModelConfig
from microscale.model.family import FAMILIES
from microscale.outputs import ExportFolder, OutputKind, QuantizeOutput, TrainingRun, kind_of
from microscale.train.config import TrainConfig
from microscale.train.state import load_checkpoint

__all__ = [
    "InitSource",
    "adopt_source_model",
    "memory_defaults",
    "check_init_shapes",
    "check_model_source",
    "load_init_weights",
    "quantize_calibration",
    "quantized_run",
    "resolve_config",
    "source_kind",
    "source_model",
]

# ModelConfig fields that decide parameter shapes (named in the mismatch hint).
_SHAPE_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "attn_head_dim",
    "tie_embeddings",
    "family",
)
# Fields that define the source model beyond its shapes: an override may not change them.
_MODEL_FIELDS = (
    *_SHAPE_FIELDS,
    "rope_theta",
    "rope_scaling",
    "norm_eps",
    "sliding_window",
    "sliding_window_pattern",
    "rope_local_theta",
    "query_pre_attn_scalar",
)
# config.json's names of those fields (and of max_seq_len), for messages: export.hf's table.
_HF_NAMES = {**_HF_KEYS, "family": "model_type"}
# Mismatches named in check_init_shapes' error (the rest are counted).
_SHOWN = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class InitSource:
    """Where a run's initial weights came from (recorded in metrics.jsonl / summary.json)."""

    # The init_from path as given.
    path: str
    # The source kind's recorded name (``OutputKind.source``): "run", "quantize" or "hf".
    kind: str
    # Checkpoint step of a run source (the quantized run's step for "quantize"), else None.
    step: int | None
    # "master" (float32 training weights) or "dequantized" (decoded from a packed file).
    weights: str
    # The source's model shape when known.
    model: ModelConfig | None
    # A sentence for the log (which weights, and why).
    note: str

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["model"] = None if self.model is None else self.model.to_dict()
        return d


def _is_hf_folder(path: Path) -> bool:
    """Whether ``path`` holds an HF-style folder (config.json: plain or packed)."""
    kind = detect(path)
    return isinstance(kind, Layout) and kind.hf_folder


# The output kinds a model source may be (each recorded under its ``source`` name).
_SOURCE_KINDS: tuple[type[OutputKind], ...] = (TrainingRun, QuantizeOutput, ExportFolder)
# What a model source folder may be (the expected part of the errors).
SOURCE_KINDS = (
    "a microscale run folder, a `microscale quantize` output or an HF folder "
    f"({', '.join(FAMILIES)})"
)


def source_kind(path: str | os.PathLike, *, what: str = "init_from=") -> type[OutputKind]:
    """``TrainingRun``, ``QuantizeOutput`` or ``ExportFolder``: which model folder ``path``
    is (:func:`microscale.outputs.kind_of`: a run's ``config.yaml`` + ``checkpoints/``; a
    quantize output's ``precision_rules.json`` + ``report.json``; an HF-style folder's
    ``config.json``), or a ``ValueError`` naming ``what`` (``"init_from="``,
    ``"--model"``) and the three kinds. Callers compare the class (``kind is
    TrainingRun``); its ``source`` is the name a run records."""
    p = Path(path).expanduser()
    kind = kind_of(p)
    if kind not in _SOURCE_KINDS or (kind is ExportFolder and not _is_hf_folder(p)):
        raise _not_a_model_folder(path, what=what)
    assert kind is not None  # one of _SOURCE_KINDS
    return kind


def check_model_source(
    source: str | os.PathLike, *, what: str = "init_from="
) -> tuple[Path, type[OutputKind]]:
    """``(path, kind)`` of a model folder given as ``what`` (``"init_from="``,
    ``"--model"``), read from names alone before any work: a missing path, a file
    (``model.gguf``) or a folder that is none of the three kinds raises the one-line error
    that names it and what was expected (:func:`~microscale.files.check_input_dir`, then
    :func:`source_kind`)."""
    path = check_input_dir(source, what=what, expected=SOURCE_KINDS)
    return path, source_kind(path, what=what)


def _not_a_model_folder(path: str | os.PathLike, *, what: str) -> ValueError:
    """The error for a folder that is none of the three model-folder kinds."""
    shown = f"{what}{'' if not what or what.endswith('=') else ' '}{str(path)!r}"
    return ValueError(
        f"{shown} is not a model folder: expected a microscale "
        "run (config.yaml + checkpoints/), a `microscale quantize` output "
        "(precision_rules.json + report.json + checkpoint/) or an HF folder of one of "
        f"{', '.join(FAMILIES)} (config.json + *.safetensors)"
    )


def quantize_calibration(path: str | os.PathLike) -> dict[str, Any]:
    """The ``calibration`` record of a quantize output's ``report.json`` (source run, step,
    corpus, ...); empty where the report has none."""
    calib = QuantizeOutput.read_report(path).calibration
    return dict(calib) if isinstance(calib, Mapping) else {}


def quantized_run(path: str | os.PathLike) -> tuple[str | None, int | None]:
    """``(run folder, step)`` a quantize output's ``report.json`` names as its source
    (``calibration.run_dir`` / ``step``; None where it names none)."""
    calib = quantize_calibration(path)
    return calib.get("run_dir"), calib.get("step")


def _from_run(path: Path, step: int | None) -> tuple[dict[str, np.ndarray], int, ModelConfig]:
    model, cfg, meta = load_checkpoint(path, step)
    flat = {k: np.asarray(v) for k, v in flat_params(model).items()}
    return flat, int(meta["step"]), cfg.model


def _from_packed(path: Path) -> tuple[dict[str, np.ndarray], ModelConfig | None]:
    """Dequantized float weights of a quantize output's model (its layout's ``read``)."""
    kind = detect(path)
    if not isinstance(kind, Layout):
        raise FileNotFoundError(
            f"{str(path)!r}: no config.json or manifest.json (expected the "
            "checkpoint/ folder that microscale quantize writes)"
        )
    return kind.read(path)


def load_init_weights(
    source: str | os.PathLike, *, step: int | None = None
) -> tuple[dict[str, np.ndarray], InitSource]:
    """``({parameter path: float array}, InitSource)`` from a run folder, a quantize output
    or an HF Llama folder (see the module doc). ``step`` applies to a run folder only."""
    path = check_input_dir(source, what="init_from=", expected=SOURCE_KINDS)
    kind = kind_of(path)
    if kind is TrainingRun:
        flat, got, model = _from_run(path, step)
        return flat, InitSource(
            path=str(source),
            kind=TrainingRun.source,
            step=got,
            weights="master",
            model=model,
            note=f"master weights of step {got} of {path}",
        )
    if step is not None:
        raise ValueError(
            f"init_step={step} applies to a run folder, but init_from="
            f"{str(source)!r} is not one (no config.yaml + checkpoints/)"
        )
    if kind is QuantizeOutput:
        run_dir, run_step = quantized_run(path)
        why = "the report names no source run"
        if run_dir:
            run = Path(run_dir)
            why = f"its source run {run_dir!r} is gone"
            if TrainingRun.detect(run):
                try:
                    flat, got, model = _from_run(run, run_step)
                except FileNotFoundError:
                    why = f"step {run_step} of its source run {run_dir!r} is gone"
                else:
                    return flat, InitSource(
                        path=str(source),
                        kind=QuantizeOutput.source,
                        step=got,
                        weights="master",
                        model=model,
                        note=f"master weights of step {got} of {run}, the run {path} quantized",
                    )
        packed = QuantizeOutput.model(path)
        flat, packed_model = _from_packed(packed)
        return flat, InitSource(
            path=str(source),
            kind=QuantizeOutput.source,
            step=None,
            weights="dequantized",
            model=packed_model,
            note=f"dequantized weights of {packed} ({why}): training starts "
            "from the quantized model, not from its master weights",
        )
    layout = detect(path)
    if isinstance(layout, Layout) and layout.hf_folder:
        ck = read_checkpoint(path, dequantize=True)
        is_packed = layout.quantized
        return (
            {k: np.asarray(v) for k, v in ck.params.items()},
            InitSource(
                path=str(source),
                kind=ExportFolder.source,
                step=None,
                weights="dequantized" if is_packed else "master",
                model=ck.config,
                note=f"{ck.layout} weights of {path}"
                + (" (dequantized: the folder holds packed weights)" if is_packed else ""),
            ),
        )
    raise _not_a_model_folder(path, what="init_from=")


def check_init_shapes(
    weights: Mapping[str, Any],
    expected: Mapping[str, tuple[int, ...]],
    source: InitSource,
    model: ModelConfig,
) -> None:
    """Raise one ``ValueError`` counting every missing, unexpected or mis-shaped parameter:
    the source's differing model fields first (the cause), then the first few parameters."""
    problems = []
    for name, shape in expected.items():
        if name not in weights:
            problems.append(f"{name} is missing (expected shape {tuple(shape)})")
        elif tuple(np.shape(weights[name])) != tuple(shape):
            problems.append(
                f"{name} has shape {tuple(np.shape(weights[name]))}, the config "
                f"expects {tuple(shape)}"
            )
    problems += [
        f"{name} is not a parameter of this model" for name in weights if name not in expected
    ]
    if not problems:
        return
    hint = ""
    if source.model is not None:
        diff = [
            f"model.{f}={getattr(source.model, f)} (config: {getattr(model, f)})"
            for f in _SHAPE_FIELDS
            if getattr(source.model, f) != getattr(model, f)
        ]
        if diff:
            hint = "the source has " + ", ".join(diff) + "; "
    more = len(problems) - _SHOWN
    raise ValueError(
        f"init_from={source.path!r} does not fit the model config: {hint}"
        f"{len(problems)} mismatch(es): "
        + "; ".join(problems[:_SHOWN])
        + (f"; and {more} more" if more > 0 else "")
    )


# ---------------------------------------------------------------------- the source's model


def source_model(source: str | os.PathLike) -> tuple[ModelConfig, Path | None, str] | None:
    """``(model config, tokenizer file or None, where the config was read)`` of an
    ``init_from`` source, read without loading weights: a run folder's ``config.yaml``,
    an HF folder's ``config.json``, a quantize output's ``checkpoint/config.json`` (or,
    in microscale's layout, its source run's). None for anything else (a path that is not
    a model folder: :func:`load_init_weights` says what is wrong)."""
    path = Path(source).expanduser()
    if QuantizeOutput.detect(path):
        run, _ = quantized_run(path)
        packed = QuantizeOutput.model(path)
        path = packed if _is_hf_folder(packed) else Path(run or path)
    if not path.is_dir():
        return None
    tok_file = path / TrainingRun.TOKENIZER
    tok = tok_file if tok_file.is_file() else None
    if TrainingRun.detect(path):
        config = path / TrainingRun.CONFIG
        return load_yaml(TrainConfig, config).model, tok, str(config)
    if _is_hf_folder(path):
        where = str(path / ExportFolder.CONFIG)
        try:
            model = model_config_from_hf(read_json(where, what=ExportFolder.CONFIG))
            model = hf_head_config(path, model)  # as load_init_weights' read_checkpoint
        except ValueError as e:
            raise ValueError(f"init_from={str(source)!r}: {e}") from None
        return model, tok, where
    return None


def adopt_source_model(cfg, overridden: set[str]):
    """``cfg`` (a TrainConfig with ``init_from``) with the source's model and tokenizer
    (see the module doc). ``overridden``: the dotted keys the user set explicitly
    (``model.d_ff``, ``data.tokenizer``; ``model`` for a whole preset)."""
    found = source_model(cfg.init_from) if cfg.init_from is not None else None
    if found is None:
        return cfg
    src, tok, where = found
    hf = where.endswith(ExportFolder.CONFIG)
    keys = (
        {f.name for f in dataclasses.fields(ModelConfig)}
        if "model" in overridden
        else {k.split(".")[1] for k in overridden if k.startswith("model.")}
    )
    for f in sorted(keys):
        mine, theirs = getattr(cfg.model, f), getattr(src, f)
        if (f in _MODEL_FIELDS and mine != theirs) or (f == "max_seq_len" and mine > theirs):
            name = _HF_NAMES[f] if hf else f"model.{f}"
            raise ValueError(
                f"model.{f}={mine} contradicts init_from={cfg.init_from!r}: "
                f"{where} has {name}={theirs} (the model is taken from "
                "init_from; drop the override)"
            )
    # The source's model; how it runs (remat, chunks, dtypes) is the config's where set,
    # else sized for the source (`memory_defaults`).
    model = cfg.model.replace(
        **{
            f: getattr(src, f)
            for f in (*_MODEL_FIELDS, "max_seq_len", "dim_multiple")
            if f not in keys
        }
    )
    seq_len = cfg.data.seq_len if "data.seq_len" in overridden else None
    sized = memory_defaults(
        model, cfg.data.batch_size, seq_len or min(cfg.data.seq_len, model.max_seq_len)
    )
    model = model.replace(**{k: v for k, v in sized.items() if k not in keys})
    data = cfg.data
    if "data.tokenizer" not in overridden:
        if tok is None and hf:  # the preset's byte tokenizer would fit and be wrong
            raise ValueError(
                f"init_from={cfg.init_from!r} has no tokenizer.json; name the "
                "model's own tokenizer with data.tokenizer=PATH"
            )
        if tok is not None:
            data = dataclasses.replace(data, tokenizer=str(tok.absolute()))
    if "data.seq_len" not in overridden and data.seq_len > model.max_seq_len:
        data = dataclasses.replace(data, seq_len=model.max_seq_len)
    return dataclasses.replace(cfg, model=model, data=data)


# Memory the run settings of an adopted model aim each large transient at (the float32
# logits of one loss chunk, one block's attention scores), and the size from which a
# model's blocks keep only their inputs for the backward pass and run as one scan.
_TRANSIENT_BYTES = 256 * 2**20
_REMAT_PARAMS = 50_000_000


def memory_defaults(model: ModelConfig, batch: int, seq_len: int) -> dict[str, Any]:
    """Run settings for a model taken from ``init_from`` (an imported model has no preset
    to carry them), at microbatch ``batch`` x ``seq_len``:

    * ``loss_chunk``: the largest power of two of positions whose float32 logits
      ``[batch, chunk, vocab]`` fit `_TRANSIENT_BYTES` (0, no chunks, when all do);
    * ``attention_chunk``: likewise for one block's float32 scores ``[batch, heads,
      chunk, seq_len]``;
    * from `_REMAT_PARAMS` parameters: ``remat="full"`` (each block keeps its input only)
      and ``scan_layers`` (one block body in the program: compile time flat in depth).

    Smaller models keep the config's settings. An explicit ``model.<key>=`` wins."""

    def chunk(bytes_per_position: int) -> int:
        if bytes_per_position * seq_len <= _TRANSIENT_BYTES:
            return 0
        c = 1 << max(0, int(_TRANSIENT_BYTES // bytes_per_position).bit_length() - 1)
        return max(16, min(c, seq_len))

    if model.num_params() < _REMAT_PARAMS:
        return {}
    return {
        "loss_chunk": chunk(4 * batch * model.vocab_size),
        "attention_chunk": chunk(4 * batch * model.n_heads * seq_len),
        "remat": "full",
        "scan_layers": True,
    }


# ------------------------------------------------------------------ resolving a config


def _with_source_context(cfg: TrainConfig, overrides: Sequence[str] | dict) -> TrainConfig:
    """``cfg`` with the model of the ``init_from`` the overrides name (what defines it, and
    its context where that is longer than the preset's), before they are applied: an
    override of a family's own field (Gemma 3's ``sliding_window_pattern``) then meets the
    source's family, not the preset's, and a ``data.seq_len`` within the source's context
    is not refused against the preset's shorter one. `adopt_source_model` then checks the
    overrides against the source."""
    items = dict(overrides) if isinstance(overrides, dict) else dict(parse_overrides(overrides))
    source = items.get("init_from", cfg.init_from)
    found = source_model(str(source)) if source not in (None, "none") else None
    if found is None:
        return cfg
    src = found[0]
    same = {f: getattr(src, f) for f in (*_MODEL_FIELDS, "dim_multiple")}
    same["max_seq_len"] = max(src.max_seq_len, cfg.model.max_seq_len)
    return dataclasses.replace(cfg, model=cfg.model.replace(**same))


def resolve_config(
    config: str | os.PathLike | TrainConfig = "tiny", overrides: Sequence[str] | dict = ()
) -> TrainConfig:
    """A preset name or YAML path (or a TrainConfig), then ``key=value`` overrides.

    With ``init_from``, the model and tokenizer are the source's (overrides that contradict
    it are refused; :func:`adopt_source_model`).

    Raises :class:`~microscale.config.ConfigError` naming the bad key/value or preset.
    """
    if isinstance(config, TrainConfig):
        cfg = config
    else:
        text = str(config)
        path = Path(text).expanduser()
        if path.suffix in (".yaml", ".yml") or path.is_file():
            cfg = load_yaml(TrainConfig, path)
        else:
            try:
                cfg = TrainConfig.preset(text)
            except ValueError as e:
                raise ConfigError(f"{e} (or the path of a YAML config file)") from None
    try:
        cfg = _with_source_context(cfg, overrides)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    cfg = apply_overrides(cfg, overrides)
    if cfg.init_from is None:
        return cfg
    items = (
        list(overrides)
        if isinstance(overrides, dict)
        else [k for k, _ in parse_overrides(overrides)]
    )
    try:
        return adopt_source_model(cfg, {TrainConfig._aliases.get(k, k) for k in items})
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None
