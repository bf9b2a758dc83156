"""``init_from=PATH``: start a training run from another model's weights.

Fine-tuning starts from trained weights, and only the weights: the optimizer state, the
step counter, the learning-rate schedule and the data position start fresh (unlike
``resume=true``, which continues one run exactly). ``PATH`` is one of

* a **microscale run folder** (``config.yaml`` + ``checkpoints/``): the float32 master
  weights of its latest checkpoint, or of ``init_step``;
* a **``microscale quantize`` output** (``precision_rules.json`` + ``report.json`` +
  ``checkpoint/``): the master weights of the run it quantized (``report.json`` records
  the run folder and step) when that checkpoint still exists; otherwise the dequantized
  weights of its ``checkpoint/`` (the run records which, and says so);
* an **HF Llama folder** (``config.json`` + safetensors; plain, compressed-tensors or
  ModelOpt), read by :func:`microscale.export.read_checkpoint` (packed weights are
  dequantized).

The weights are checked against the run's model config before anything trains: every
missing, unexpected or differently shaped parameter is named in one error, with the
source's model shape when it is known.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from microscale.files import check_input_dir
from microscale.model import ModelConfig

__all__ = ["InitSource", "check_init_shapes", "load_init_weights"]

# ModelConfig fields that decide parameter shapes (named in the mismatch hint).
_SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                 "tie_embeddings")


@dataclasses.dataclass(frozen=True, kw_only=True)
class InitSource:
    """Where a run's initial weights came from (recorded in metrics.jsonl / summary.json)."""

    # The init_from path as given.
    path: str
    # "run", "quantize" or "hf".
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


def _is_run(p: Path) -> bool:
    return (p / "config.yaml").is_file() and (p / "checkpoints").is_dir()


def _is_quantize_output(p: Path) -> bool:
    return (p / "precision_rules.json").is_file() and (p / "report.json").is_file()


def _from_run(path: Path, step: int | None) -> tuple[dict[str, np.ndarray], int, ModelConfig]:
    from microscale.export import flat_params
    from microscale.train.loop import load_checkpoint

    model, cfg, meta = load_checkpoint(path, step)
    flat = {k: np.asarray(v) for k, v in flat_params(model).items()}
    return flat, int(meta["step"]), cfg.model


def _from_packed(path: Path) -> tuple[dict[str, np.ndarray], ModelConfig | None]:
    """Dequantized float weights of a quantize output's ``checkpoint/`` folder."""
    from microscale.formats import dequantize

    if (path / "config.json").is_file():
        from microscale.export import read_checkpoint

        ck = read_checkpoint(path, dequantize=True)
        return {k: np.asarray(v) for k, v in ck.params.items()}, ck.config
    if (path / "manifest.json").is_file():
        from microscale.ptq.report import read_own_checkpoint

        qs, params, _ = read_own_checkpoint(path)
        flat = {k: np.asarray(v, np.float32) for k, v in params.items()}
        for p, q in qs.items():  # stored [out, in]; kernels are [in, out]
            flat[f"{p}.kernel"] = np.asarray(dequantize(q, np.float32)).T
        return flat, None
    raise FileNotFoundError(f"{str(path)!r}: no config.json or manifest.json (expected the "
                            "checkpoint/ folder that microscale quantize writes)")


def load_init_weights(source: str | os.PathLike, *, step: int | None = None
                      ) -> tuple[dict[str, np.ndarray], InitSource]:
    """``({parameter path: float array}, InitSource)`` from a run folder, a quantize output
    or an HF Llama folder (see the module doc). ``step`` applies to a run folder only."""
    path = check_input_dir(source, what="init_from=", expected="a microscale run folder, a "
                           "`microscale quantize` output or an HF Llama folder")
    if _is_run(path):
        flat, got, model = _from_run(path, step)
        return flat, InitSource(path=str(source), kind="run", step=got, weights="master",
                                model=model, note=f"master weights of step {got} of {path}")
    if step is not None:
        raise ValueError(f"init_step={step} applies to a run folder, but init_from="
                         f"{str(source)!r} is not one (no config.yaml + checkpoints/)")
    if _is_quantize_output(path):
        report = json.loads((path / "report.json").read_text())
        calib = report.get("calibration") or {}
        run_dir, run_step = calib.get("run_dir"), calib.get("step")
        why = "the report names no source run"
        if run_dir:
            run = Path(run_dir)
            why = f"its source run {run_dir!r} is gone"
            if _is_run(run):
                try:
                    flat, got, model = _from_run(run, run_step)
                except FileNotFoundError:
                    why = f"step {run_step} of its source run {run_dir!r} is gone"
                else:
                    return flat, InitSource(
                        path=str(source), kind="quantize", step=got, weights="master",
                        model=model, note=f"master weights of step {got} of {run}, the run "
                                          f"{path} quantized")
        flat, model = _from_packed(path / "checkpoint")
        return flat, InitSource(
            path=str(source), kind="quantize", step=None, weights="dequantized", model=model,
            note=f"dequantized weights of {path / 'checkpoint'} ({why}): training starts "
                 "from the quantized model, not from its master weights")
    if (path / "config.json").is_file():
        from microscale.export import read_checkpoint

        ck = read_checkpoint(path, dequantize=True)
        packed = ck.layout != "hf"
        return ({k: np.asarray(v) for k, v in ck.params.items()},
                InitSource(path=str(source), kind="hf", step=None,
                           weights="dequantized" if packed else "master", model=ck.config,
                           note=f"{ck.layout} weights of {path}"
                                + (" (dequantized: the folder holds packed weights)"
                                   if packed else "")))
    raise ValueError(f"init_from={str(source)!r} is not a model folder: expected a microscale "
                     "run (config.yaml + checkpoints/), a `microscale quantize` output "
                     "(precision_rules.json + report.json + checkpoint/) or an HF Llama folder "
                     "(config.json + *.safetensors)")


def check_init_shapes(weights: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]],
                      source: InitSource, model: ModelConfig) -> None:
    """Raise one ``ValueError`` naming every missing, unexpected or mis-shaped parameter."""
    problems = []
    for name, shape in expected.items():
        if name not in weights:
            problems.append(f"{name} is missing (expected shape {tuple(shape)})")
        elif tuple(np.shape(weights[name])) != tuple(shape):
            problems.append(f"{name} has shape {tuple(np.shape(weights[name]))}, the config "
                            f"expects {tuple(shape)}")
    problems += [f"{name} is not a parameter of this model" for name in weights
                 if name not in expected]
    if not problems:
        return
    hint = ""
    if source.model is not None:
        diff = [f"model.{f}={getattr(source.model, f)} (config: {getattr(model, f)})"
                for f in _SHAPE_FIELDS if getattr(source.model, f) != getattr(model, f)]
        if diff:
            hint = "; the source has " + ", ".join(diff)
    raise ValueError(f"init_from={source.path!r} does not fit the model config: "
                     f"{len(problems)} mismatch(es): " + "; ".join(problems) + hint)
