"""Workflows over whole run folders that need both training and quantization.

``quantize_run`` reads a training run (``microscale.train``) and quantizes it
(``microscale.ptq``); ``train`` is itself a client of ``ptq`` (``train.adaptive`` chooses
bf16 layers with ptq's scores), so this layer sits above both::

    from microscale.ptq import QuantizeConfig
    from microscale.workflows import quantize_run

    result = quantize_run("runs/tiny", "out/q", QuantizeConfig(budget=4.8))

Modules: :mod:`~microscale.workflows.quantize` (``quantize_run``).
"""

from microscale.workflows.quantize import (
    MODEL_DEFAULT_CORPUS,
    MODEL_EVAL_BATCHES,
    MODEL_ROWS,
    MODEL_SEQ_LEN,
    quantize_run,
)

__all__ = [
    "MODEL_DEFAULT_CORPUS",
    "MODEL_EVAL_BATCHES",
    "MODEL_ROWS",
    "MODEL_SEQ_LEN",
    "quantize_run",
]
