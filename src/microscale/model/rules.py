"""Per-layer precision rules: which recipe each linear layer trains in.

Precision is data, not code. A `PrecisionRules` is an ordered list of
``(regex, recipe)`` pairs plus a default. A linear layer is named by its dotted module path
in the NNX graph (``"layers.3.attn.q_proj"``, ``"blocks.0.fc1"`` in a user model); the
first rule whose regex **fully matches** the path (``re.fullmatch``) gives its recipe;
no match gives ``default``. The same object drives training, PTQ, export and inference
and round-trips through JSON::

    {"rules": [["layers\\\\.3\\\\..*", "bf16"]], "default": "nvfp4"}

A recipe is a name from ``microscale.ops.list_recipes()`` or a full ``Recipe`` (stored
as its ``to_dict()`` in JSON), which is how derived recipes such as the late switch's
"bf16 forward, low-precision backward" travel.

Default layout (``PrecisionRules.for_recipe``). NVIDIA's NVFP4 recipe (arXiv 2509.25149)
keeps a few blocks in BF16: the first 2 and last 8 of a 62-block model (~16%). The blocks
nearest the loss see the largest, most outlier-prone gradients, so by default we keep the
**last 15%** of blocks in BF16 (rounded half up, at least 1): 4 layers -> last 1,
16 -> last 2, 32 -> last 5, 62 -> last 9. ``bf16_first``/``bf16_last`` override, and
`BF16_LAYOUTS` names layouts: ``"paper_12b"`` is the paper's first 2 + last 8.
A recipe that quantizes nothing (``bf16``) gets no special rules. On very small models
the default would keep most blocks in BF16 (2 layers -> 1 of 2): ``for_recipe`` warns
when it keeps half or more, and refuses when it would leave no block quantized
(1 layer), since a run labelled "nvfp4" would then train entirely in BF16.

Embeddings, norms, attention score/value products and the LM head are not linear layers
here: microscale's `Transformer` always runs them in high precision and the rules never
see them.

`apply_rules(model, rules)` works on any Flax NNX model. It walks the graph
(`nnx.iter_graph`) and, for each matched layer:

* microscale `QLinear`: sets ``.recipe`` (and ``.layer_id`` from the path). The
  `Transformer` passes a fresh PRNG key on every call and each QLinear folds its
  ``layer_id`` into it, so stochastic rounding differs per step and per layer.
* ``nnx.Linear`` / ``nnx.LinearGeneral``: replaces ``.dot_general`` with
  ``make_dot_general(recipe, key=...)``; ``nnx.Einsum``: replaces ``.einsum_op`` with
  ``jnp.einsum`` using that ``dot_general``. A flax layer has no key argument, so the
  key is **fixed per layer**: ``fold_in(key(seed), crc32(path))``. Stochastic rounding
  then uses the same random bits every step (still unbiased per element across
  elements, but correlated across steps); use microscale's `Transformer`/`QLinear` or
  re-apply the rules with a new ``seed`` each step if that matters.

Changing a layer's recipe changes static attributes of the module graph: `nnx.jit`
retraces on the next call; code that holds a ``graphdef`` from ``nnx.split`` must split
again.

Late switch (paper, Appendix D): after training most tokens in low precision, train the
last ~18% in BF16. `late_switch(rules, bf16)` returns the rules for that phase, ``bf16``
naming what runs in bf16: ``"all"`` (forward and backward) or ``"forward"`` (only the
forward GEMM; each layer keeps its low-precision dgrad/wgrad, recipe named
``"<name>+bf16_forward"`` by ``Recipe.derive``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import warnings
import zlib
from collections.abc import Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from microscale.files import atomic_write_text, read_json
from microscale.model.layers import QLinear
from microscale.ops import (
    Recipe,
    RecipeLike,
    get_recipe,
    make_dot_general,
    recipe_name,
)

__all__ = [
    "BF16_LAYOUTS",
    "PrecisionRules",
    "RecipeLike",
    "apply_rules",
    "assignments",
    "default_bf16_last",
    "iter_linears",
    "late_switch",
    "path_id",
    "path_key",
    "path_str",
    "quantized_blocks",
    "recipe_name",
    "rules_for_training",
]


# Named (bf16_first, bf16_last) layouts of the blocks kept in high precision.
BF16_LAYOUTS: dict[str, tuple[int, int]] = {
    # arXiv 2509.25149's 12B model (62 blocks): the first 2 and the last 8 in BF16.
    "paper_12b": (2, 8),
}

# Flax layer types whose matmul apply_rules can redirect, by attribute it replaces.
_FLAX_DOT_GENERAL = (nnx.Linear, nnx.LinearGeneral)
_FLAX_EINSUM = (nnx.Einsum,)


def _check_recipe(where: str, recipe: Any) -> RecipeLike:
    if isinstance(recipe, dict):
        recipe = Recipe.from_dict(recipe)
    if not isinstance(recipe, (str, Recipe)):
        raise TypeError(
            f"{where}: recipe {recipe!r} ({type(recipe).__name__}): expected a "
            "recipe name (str) or a microscale.ops.Recipe"
        )
    try:
        get_recipe(recipe)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return recipe


def _recipe_json(recipe: RecipeLike | None) -> Any:
    return recipe if recipe is None or isinstance(recipe, str) else recipe.to_dict()


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionRules:
    """Ordered (module-path regex -> recipe) rules, first match wins, then ``default``."""

    # (regex, recipe) pairs, tried in order with re.fullmatch on the dotted module path.
    rules: tuple[tuple[str, RecipeLike], ...] = ()
    # Recipe of layers no rule matches; None leaves such layers as they are.
    default: RecipeLike | None = "bf16"

    def __post_init__(self) -> None:
        checked = []
        for i, item in enumerate(self.rules):
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError(
                    f"PrecisionRules.rules[{i}]={item!r}: expected a (regex, recipe) pair"
                )
            pattern, recipe = item
            if not isinstance(pattern, str):
                raise TypeError(
                    f"PrecisionRules.rules[{i}] pattern {pattern!r}: expected a regex string"
                )
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(
                    f"PrecisionRules.rules[{i}] pattern {pattern!r} is not a valid regex: {e}"
                ) from None
            checked.append((pattern, _check_recipe(f"PrecisionRules.rules[{i}]", recipe)))
        object.__setattr__(self, "rules", tuple(checked))
        if self.default is not None:
            object.__setattr__(
                self, "default", _check_recipe("PrecisionRules.default", self.default)
            )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def uniform(cls, recipe: RecipeLike) -> PrecisionRules:
        """Every linear layer in ``recipe``."""
        return cls(default=recipe)

    @classmethod
    def for_recipe(
        cls,
        recipe: RecipeLike,
        n_layers: int,
        *,
        bf16_first: int = 0,
        bf16_last: int | None = None,
        high_precision: RecipeLike = "bf16",
        block_prefix: str = "layers",
    ) -> PrecisionRules:
        """``recipe`` everywhere except the first ``bf16_first`` and last ``bf16_last``
        blocks (paths ``"<block_prefix>.<i>.*"``), which get ``high_precision``.

        ``bf16_last=None`` means `default_bf16_last` (15%, at least 1) for a recipe that
        quantizes something and 0 for one that does not (bf16 gets no special rules).
        """
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers <= 0:
            raise ValueError(f"n_layers={n_layers!r}: expected a positive int")
        quantized = get_recipe(recipe).quantized
        default = bf16_last is None
        if default:
            bf16_last = default_bf16_last(n_layers) if quantized else 0
        assert bf16_last is not None
        for name, v in (("bf16_first", bf16_first), ("bf16_last", bf16_last)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}={v!r}: expected an int >= 0")
        if bf16_first + bf16_last > n_layers:
            raise ValueError(
                f"bf16_first={bf16_first} + bf16_last={bf16_last} exceeds "
                f"n_layers={n_layers}: expected at most n_layers blocks kept "
                "in high precision"
            )
        keep = sorted(set(range(bf16_first)) | set(range(n_layers - bf16_last, n_layers)))
        if quantized and keep:
            _check_kept(
                str(recipe_name(recipe)), n_layers, len(keep), bf16_first, bf16_last, default
            )
        rules: tuple[tuple[str, RecipeLike], ...] = ()
        if keep:
            alts = "|".join(str(i) for i in keep)
            rules = ((rf"{re.escape(block_prefix)}\.({alts})\..*", high_precision),)
        return cls(rules=rules, default=recipe)

    # ------------------------------------------------------------------ queries
    def resolve(self, path: str) -> RecipeLike | None:
        """Recipe for a dotted module path: first fully matching rule, else default."""
        for pattern, recipe in self.rules:
            if re.fullmatch(pattern, path):
                return recipe
        return self.default

    def resolve_name(self, path: str) -> str | None:
        """Like `resolve`, but the recipe's name."""
        return recipe_name(self.resolve(path))

    def assignments(self, model: Any) -> dict[str, str | None]:
        """{dotted path: recipe name} for every linear layer of ``model``."""
        return {path: self.resolve_name(path) for path, _ in iter_linears(model)}

    def then(self, pattern: str, recipe: RecipeLike) -> PrecisionRules:
        """A copy with one more rule appended (lowest priority before the default)."""
        return dataclasses.replace(self, rules=self.rules + ((pattern, recipe),))

    def prepend(self, pattern: str, recipe: RecipeLike) -> PrecisionRules:
        """A copy with one more rule in front (highest priority)."""
        return dataclasses.replace(self, rules=((pattern, recipe),) + self.rules)

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        return {
            "rules": [[p, _recipe_json(r)] for p, r in self.rules],
            "default": _recipe_json(self.default),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrecisionRules:
        if not isinstance(d, dict):
            raise TypeError(f"PrecisionRules.from_dict expected a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - {"rules", "default"})
        if unknown:
            raise ValueError(
                f"PrecisionRules: unknown key(s) {unknown}; expected 'rules' and/or 'default'"
            )
        rules = d.get("rules", [])
        if not isinstance(rules, (list, tuple)):
            raise TypeError(
                f"PrecisionRules 'rules'={rules!r}: expected a list of [regex, recipe] pairs"
            )
        return cls(
            rules=tuple(tuple(r) if isinstance(r, (list, tuple)) else r for r in rules),
            default=d.get("default", "bf16"),
        )

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> PrecisionRules:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_text(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> PrecisionRules:
        """Read a rules JSON file; errors name the file."""
        obj = read_json(path, what="precision rules")
        try:
            return cls.from_dict(obj)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"precision rules {str(path)!r}: {e}") from None


# ---------------------------------------------------------------------- graph helpers


def path_str(parts: tuple[Any, ...]) -> str:
    """('layers', 0, 'attn', 'q_proj') -> 'layers.0.attn.q_proj'."""
    return ".".join(str(p) for p in parts)


def path_key(key: jax.Array, path: str) -> jax.Array:
    """A per-layer key: ``fold_in(key, crc32(path))`` (stable across runs and processes)."""
    return jax.random.fold_in(key, path_id(path))


def path_id(path: str) -> int:
    """A stable 31-bit integer id of a module path (crc32)."""
    return zlib.crc32(path.encode()) & 0x7FFFFFFF


def _is_linear(node: Any) -> bool:
    return isinstance(node, (QLinear, *_FLAX_DOT_GENERAL, *_FLAX_EINSUM))


def iter_linears(model: Any) -> Iterator[tuple[str, Any]]:
    """(dotted path, module) for every QLinear / nnx.Linear / LinearGeneral / Einsum."""
    for parts, node in nnx.iter_graph(model):
        if _is_linear(node):
            yield path_str(parts), node


def assignments(model: Any, rules: PrecisionRules | None = None) -> dict[str, str | None]:
    """{path: recipe name} — from ``rules`` if given, else what each layer currently runs
    (None for a flax layer that apply_rules never touched)."""
    if rules is not None:
        return rules.assignments(model)
    return {path: recipe_name(_current_recipe(node)) for path, node in iter_linears(model)}


def _current_recipe(node: Any) -> RecipeLike | None:
    if isinstance(node, QLinear):
        return node.recipe
    fn = (
        getattr(node, "einsum_op", None)
        if isinstance(node, _FLAX_EINSUM)
        else getattr(node, "dot_general", None)
    )
    return getattr(fn, "microscale_recipe", None)


def apply_rules(model: Any, rules: PrecisionRules, *, seed: int = 0) -> dict[str, str | None]:
    """Set every matched linear layer of any NNX ``model`` to its rule's recipe, in place.

    Returns {path: recipe name} of the layers touched (None: left as is). ``seed`` makes
    the fixed per-layer keys of flax layers (see the module docstring).
    """
    if not isinstance(rules, PrecisionRules):
        raise TypeError(f"apply_rules: rules={rules!r}: expected a PrecisionRules")
    base = jax.random.key(seed)
    out: dict[str, str | None] = {}
    for path, node in list(iter_linears(model)):
        recipe = rules.resolve(path)
        out[path] = recipe_name(recipe)
        if recipe is None:
            continue
        if get_recipe(recipe).delayed:
            raise ValueError(
                f"layer {path!r}: recipe {recipe_name(recipe)!r} uses delayed "
                "scaling, whose amax history is per-layer state that precision "
                "rules do not carry (microscale train uses current scaling). "
                "For your own model, pass microscale.ops.delayed."
                "DelayedScalingDot(...) as the layer's dot_general"
            )
        if isinstance(node, QLinear):
            node.recipe = recipe
            node.layer_id = path_id(path)
            continue
        dg = make_dot_general(recipe, key=path_key(base, path))
        if isinstance(node, _FLAX_EINSUM):
            op = functools.partial(jnp.einsum, _dot_general=dg)
            op.microscale_recipe = recipe  # type: ignore[attr-defined]
            node.einsum_op = op
        else:
            dg.microscale_recipe = recipe
            node.dot_general = dg
    return out


def late_switch(rules: PrecisionRules, bf16: Literal["all", "forward"] = "all") -> PrecisionRules:
    """Rules for the late high-precision phase (paper, Appendix D); ``bf16`` names what runs
    in bf16.

    ``"all"``: every layer in bf16, forward and backward. ``"forward"``: each layer's
    recipe with its forward GEMM in bf16 (dgrad/wgrad unchanged), ``Recipe.derive(bf16=
    "forward")``, named ``"<name>+bf16_forward"``; layers already in a non-quantizing
    recipe are unchanged. Re-apply with `apply_rules`.
    """
    if bf16 == "all":
        return PrecisionRules(default="bf16")
    if bf16 != "forward":
        raise ValueError(f"late_switch bf16={bf16!r}: expected 'all' or 'forward'")
    return _map_quantized(rules, lambda r, _: r.derive(bf16="forward"))


def _map_quantized(rules: PrecisionRules, fn) -> PrecisionRules:
    """``rules`` with every quantizing recipe replaced by ``fn(Recipe, as_written)``; layers
    left unassigned (None) or in a non-quantizing recipe are kept as written."""

    def convert(recipe: RecipeLike | None) -> RecipeLike | None:
        if recipe is None:
            return None
        r = get_recipe(recipe)
        return fn(r, recipe) if r.quantized else recipe

    return PrecisionRules(
        rules=tuple((p, convert(r)) for p, r in rules.rules),  # type: ignore[misc]
        default=convert(rules.default),
    )


def _check_kept(name: str, n_layers: int, kept: int, first: int, last: int, default: bool) -> None:
    """Refuse a *default* that quantizes no block; warn when half or more stay in BF16."""
    what = (
        f"recipe {name!r} on {n_layers} block(s) keeps {kept} in bf16 "
        f"(bf16_first={first}, bf16_last={last}"
        + (", the default: last 15%, at least 1)" if default else ")")
    )
    if kept == n_layers:
        if default:
            raise ValueError(
                f"{what}, so no block would be quantized: set bf16_last=0 "
                "(precision.bf16_last=0) to quantize every block, or use more "
                "layers"
            )
        warnings.warn(f"{what}: no block is quantized", UserWarning, stacklevel=3)
    elif 2 * kept >= n_layers:
        warnings.warn(
            f"{what}: only {n_layers - kept} of {n_layers} blocks are quantized",
            UserWarning,
            stacklevel=3,
        )


def quantized_blocks(
    assign: dict[str, RecipeLike | None], block_prefix: str = "layers"
) -> tuple[list[int], list[int]]:
    """(blocks with a quantized linear, blocks without one) of ``{path: recipe}`` (a
    preset name or a Recipe, e.g. `assignments` or `PrecisionRules.resolve`); a block is
    ``"<block_prefix>.<i>"``."""
    blocks: dict[int, bool] = {}
    pat = re.compile(rf"{re.escape(block_prefix)}\.(\d+)\..*")
    for path, name in assign.items():
        m = pat.fullmatch(path)
        if m:
            i = int(m.group(1))
            q = name is not None and get_recipe(name).quantized
            blocks[i] = blocks.get(i, False) or q
    return ([i for i in sorted(blocks) if blocks[i]], [i for i in sorted(blocks) if not blocks[i]])


def default_bf16_last(n_layers: int) -> int:
    """Trailing blocks `PrecisionRules.for_recipe` keeps in bf16 by default: 15% of the
    blocks rounded half up, at least 1 (4 -> 1, 16 -> 2, 32 -> 5, 62 -> 9)."""
    return max(1, math.floor(0.15 * n_layers + 0.5))


def rules_for_training(
    rules: PrecisionRules, bf16: Literal["backward", "nothing", "as_written"] = "backward"
) -> PrecisionRules:
    """How a rule set (e.g. the allocation ``microscale quantize`` searched) trains;
    ``bf16`` names what of each quantized recipe runs in bf16.

    ``"backward"`` (quantization-aware fine-tuning): each quantized recipe keeps its forward
    GEMM and runs dgrad/wgrad in bf16 (the backward pass sees the unquantized weight and
    output gradient, i.e. straight-through gradients): ``Recipe.derive(bf16="backward")``,
    named ``"<name>+bf16_backward"``, when that changes it. ``"nothing"``: each layer whose
    recipe leaves the backward pass unquantized gets the full training recipe of its weight
    format (the preset named like the format: ``nvfp4``, ``mxfp4``, ``mxfp8``,
    ``fp8_e4m3``); recipes that already quantize the backward pass are kept.
    ``"as_written"``: unchanged.
    """
    if bf16 == "as_written":
        return rules
    if bf16 not in ("backward", "nothing"):
        raise ValueError(f"rules bf16={bf16!r}: expected 'backward', 'nothing' or 'as_written'")

    def convert(r: Recipe, recipe: RecipeLike) -> RecipeLike:
        backward_quantized = r.forward_only() != r
        if bf16 == "backward":
            return r.derive(bf16="backward") if backward_quantized else recipe
        if backward_quantized:
            return recipe
        fmt = r.fprop_w.format if r.fprop_w.quantized else r.fprop_x.format
        try:
            return get_recipe(fmt).name
        except ValueError:
            raise ValueError(
                f"recipe {r.name!r}: no full training recipe for its format "
                f"{fmt!r} (expected a preset named like the format)"
            ) from None

    return _map_quantized(rules, convert)
