"""Intercept the linear layers of an NNX model inside one traced function.

PTQ needs, per linear layer ``Y = X W``, things the model does not return: its input
``X`` (activation amax, ``Y_q - Y = X (W_q - W)``), the gradient of the loss with respect
to its output ``dL/dY``, or a quantized input ``Q(X)``. PyTorch tools use forward hooks;
in JAX the same is a function of the *traced* computation:

* ``dL/dY`` for every layer from one backward pass: add a zero perturbation ``e_l`` to
  each output, ``Y_l + e_l``, and differentiate the loss with respect to the ``e``\\ s
  (``jax.vjp``): ``dL/de_l = dL/dY_l`` because ``dY_l/de_l = I``.
* ``X_l``: return it from the traced function as an auxiliary output.

:func:`intercept_linears` routes each linear module's call through
``hook(path, call, x) -> y`` (``call(x)`` runs the layer as usual) for the duration of a
``with`` block. It does so by giving each linear *instance* of the model a subclass whose
``__call__`` consults the hook table, and restoring the class afterwards; no model code
changes and no other instance is touched. Use it on a model you own inside the traced
function (``nnx.merge`` creates fresh instances there). Transforms that copy modules
(``nnx.remat``/``nnx.scan`` around blocks) would call copies the table does not know: that
raises rather than silently skipping the hook, so turn block remat off while tapping
(:func:`without_remat`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax

from microscale.model import iter_linears

__all__ = ["Hook", "intercept_linears", "tappable_paths", "without_remat"]

# hook(path, call, x) -> y
Hook = Callable[[str, Callable[[jax.Array], jax.Array], jax.Array], jax.Array]

_SUBCLASSES: dict[type, type] = {}
# id(instance) -> (path, hook) of the instances currently tapped.
_ACTIVE: dict[int, tuple[str, Hook]] = {}


def _tapped_class(cls: type) -> type:
    if cls not in _SUBCLASSES:

        def __call__(self, x, *args, **kwargs):
            entry = _ACTIVE.get(id(self))
            if entry is None:
                raise RuntimeError(
                    f"a tapped {cls.__name__} was called outside its intercept_linears block "
                    "or through a transform that copies modules (nnx.remat / nnx.scan); "
                    "turn block remat off while tapping (quantize.tap.without_remat)"
                )
            path, hook = entry
            return hook(path, lambda v: cls.__call__(self, v, *args, **kwargs), x)

        _SUBCLASSES[cls] = type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})
    return _SUBCLASSES[cls]


def tappable_paths(model: Any) -> list[str]:
    """Dotted paths of the linear layers with a 2-D ``kernel`` ``[in, out]``."""
    return [p for p, m in iter_linears(model) if _kernel_2d(m)]


def _kernel_2d(m: Any) -> bool:
    k = getattr(m, "kernel", None)
    return k is not None and len(getattr(k, "shape", ())) == 2


@contextlib.contextmanager
def intercept_linears(model: Any, hook: Hook, paths: set[str] | None = None) -> Iterator[None]:
    """Route the calls of ``model``'s linear layers (those in ``paths``; default all with a
    2-D kernel) through ``hook`` inside the ``with`` block."""
    swapped = []
    try:
        for path, mod in iter_linears(model):
            if (paths is not None and path not in paths) or not _kernel_2d(mod):
                continue
            cls = type(mod)
            object.__setattr__(mod, "__class__", _tapped_class(cls))
            _ACTIVE[id(mod)] = (path, hook)
            swapped.append((mod, cls))
        yield
    finally:
        for mod, cls in swapped:
            _ACTIVE.pop(id(mod), None)
            object.__setattr__(mod, "__class__", cls)


def without_remat(model: Any) -> None:
    """Turn off microscale's per-block remat on ``model`` (in place; a model you own)."""
    cfg = getattr(model, "config", None)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type) and getattr(cfg, "remat", False):
        model.config = dataclasses.replace(cfg, remat=False)
