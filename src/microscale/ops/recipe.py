"""Recipes: which operand of which GEMM gets which format.

A linear layer ``Y = X W`` (X ``[M, K]`` tokens x features, W ``[K, N]``) runs three GEMMs:

====== =================== ============ =========================================
GEMM   product             contracts    operand slots of a :class:`Recipe`
====== =================== ============ =========================================
fprop  ``Y  = X W``        K (features) ``fprop_x``, ``fprop_w``
dgrad  ``dX = dY W^T``     N (outputs)  ``dgrad_dy``, ``dgrad_w``
wgrad  ``dW = X^T dY``     M (tokens)   ``wgrad_x``, ``wgrad_dy``
====== =================== ============ =========================================

Each slot is an :class:`OperandSpec` (format, block shape, rounding, Hadamard). Blocks
always run along the GEMM's contraction axis, because that is where a block-scaled
tensor core reads one scale per block of a dot product. A recipe is frozen and
hashable, so it can be static ``jit`` metadata, and round-trips through JSON
(:meth:`Recipe.to_dict` / :meth:`Recipe.from_dict`).

Presets (:func:`list_recipes`; the first column is what ``get_recipe`` accepts):

================ ============================== ============================== ==========================
recipe           fprop (X, W)                   dgrad (dY, W)                  wgrad (X, dY)
================ ============================== ============================== ==========================
bf16             bf16, bf16                     bf16, bf16                     bf16, bf16
fp8              E4M3, E4M3 (per tensor, RNE)   E5M2, E4M3 (W reused)          E4M3 (X reused), E5M2
fp8_e4m3         E4M3, E4M3                     E4M3, E4M3                     E4M3, E4M3
fp8_delayed      as fp8, tensor scales from a 16-step amax history (delayed scaling)
mxfp8            MXFP8 1x32, MXFP8 1x32         MXFP8 1x32, MXFP8 1x32         MXFP8 1x32, MXFP8 1x32
nvfp4            NVFP4 1x16 RNE, 16x16 RNE      1x16 SR, 16x16 (W reused)      1x16 RNE + RHT16, SR + RHT16
nvfp4_no_rht     as nvfp4, no Hadamard in wgrad
nvfp4_no_sr      as nvfp4, dY rounded to nearest
nvfp4_1d         as nvfp4, W in 1x16 blocks (requantized along N for dgrad)
nvfp4_rne_1d     as nvfp4, no Hadamard, no SR, W in 1x16 blocks
nvfp4_fwd_only   NVFP4 as nvfp4                 bf16                           bf16
mxfp4            MXFP4 1x32 RNE                 MXFP4 1x32 RNE                 MXFP4 1x32 RNE
mxfp4_rht_sr     MXFP4 1x32 RNE                 dY SR                          RHT32, dY SR
mxfp8_fwd_only   MXFP8 as mxfp8                 bf16                           bf16
================ ============================== ============================== ==========================

Why NVFP4 is split this way (arXiv 2509.25149): activations and weights are rounded to
nearest (lowest error for a forward pass that must match inference); gradients use
stochastic rounding so that their quantization error is zero-mean and does not bias
the optimizer; weights use 16x16 tiles so that ``W`` and ``W^T`` quantize to the same
values and the backward pass differentiates the same function the forward computed;
the wgrad GEMM sums over thousands of tokens where outliers concentrate, so both its
operands are rotated by a random Hadamard transform along the token axis first (the
rotation cancels in ``X^T R R^T dY``).

FP8 ``fp8`` is Transformer Engine's default hybrid: E4M3 (more mantissa) for the forward
operands, E5M2 (more range) for gradients; per-tensor current scaling. ``fp8_delayed``
takes each tensor scale from the amax of earlier steps instead (Transformer Engine's
``DelayedScaling``): the scale is known before the tensor is read, at the price of
saturating when a tensor grows faster than its history.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from microscale.formats import FormatSpec, get_format

Rounding = Literal["nearest", "stochastic"]
Scaling = Literal["current", "delayed"]
# (lhs slot, rhs slot) of each GEMM.
SLOT_PAIRS = {
    "fprop": ("fprop_x", "fprop_w"),
    "dgrad": ("dgrad_dy", "dgrad_w"),
    "wgrad": ("wgrad_x", "wgrad_dy"),
}
GEMMS = tuple(SLOT_PAIRS)
SLOTS = tuple(slot for pair in SLOT_PAIRS.values() for slot in pair)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OperandSpec:
    """How one operand of one GEMM is quantized. Frozen, hashable."""

    # Format registry name ("bf16", "nvfp4", "mxfp4", "mxfp8", "fp8_e4m3", "fp8_e5m2").
    format: str = "bf16"
    # Block extents (along the contraction axis, along the operand's other axis);
    # None = the format's 1-D blocks (``block_size`` x 1). (16, 16) = one scale per tile.
    block_shape: tuple[int, int] | None = None
    # "nearest" (round-to-nearest-even) or "stochastic" (needs a key).
    rounding: Rounding = "nearest"
    # Random Hadamard transform size along the contraction axis (power of two), or None.
    # Both operands of a GEMM must agree, so the rotation cancels in the product.
    hadamard: int | None = None
    # MX scale rule override ("floor" OCP / "ceil" NVIDIA); None = the format's default.
    scale_rounding: Literal["floor", "ceil"] | None = None

    def __post_init__(self):
        spec = get_format(self.format)  # raises on unknown names
        if self.rounding not in ("nearest", "stochastic"):
            raise ValueError(
                f"unknown rounding {self.rounding!r}; expected 'nearest' or 'stochastic'"
            )
        if self.block_shape is not None:
            bs = tuple(int(b) for b in self.block_shape)
            object.__setattr__(self, "block_shape", bs)
            if len(bs) != 2 or min(bs) < 1:
                raise ValueError(
                    f"block_shape={self.block_shape!r}: expected None or "
                    "(along contraction, along the other axis), both >= 1"
                )
            if spec.block_size is None or bs[0] != spec.block_size:
                raise ValueError(
                    f"block_shape={bs!r} does not fit format {self.format!r}: "
                    f"its block size is {spec.block_size} (expected "
                    f"({spec.block_size}, n) or None)"
                )
        h = self.hadamard
        if h is not None and (int(h) < 2 or int(h) & (int(h) - 1)):
            raise ValueError(f"hadamard={h!r}: expected None or a power of two >= 2 (e.g. 16)")
        if self.scale_rounding not in (None, "floor", "ceil"):
            raise ValueError(
                f"unknown scale_rounding {self.scale_rounding!r}; expected None, 'floor' or 'ceil'"
            )

    @property
    def spec(self) -> FormatSpec:
        return get_format(self.format)

    @property
    def quantized(self) -> bool:
        return self.spec.quantized

    @property
    def stochastic(self) -> bool:
        return self.quantized and self.rounding == "stochastic"

    @property
    def transpose_invariant(self) -> bool:
        """True when quantizing along either axis gives the same values (so one
        quantized copy can serve two GEMMs that contract different axes)."""
        if self.rounding != "nearest" or self.hadamard is not None:
            return False
        spec = self.spec
        if spec.block_size is None:  # bf16 pass-through or one scale per tensor
            return True
        bs = self.block_shape
        return bs is not None and bs[0] == bs[1]

    def quantize_kwargs(self, axis: int, key=None) -> dict[str, Any]:
        """Keyword arguments of ``formats.quantize`` / ``quantize_dequantize`` for this
        operand contracting along ``axis`` (-1 or -2): ``block_shape`` (along, other)
        becomes the array order of the last two dims; ``key`` only for stochastic rounding."""
        bs = self.block_shape
        if bs is not None and axis == -1:
            bs = bs[::-1]
        return dict(
            axis=axis,
            rounding=self.rounding,
            key=key if self.stochastic else None,
            block_shape=bs,
            scale_rounding=self.scale_rounding,
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["block_shape"] is not None:
            d["block_shape"] = list(d["block_shape"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OperandSpec:
        _check_keys(cls, d)
        d = dict(d)
        if d.get("block_shape") is not None:
            d["block_shape"] = tuple(d["block_shape"])
        return cls(**d)


BF16 = OperandSpec()

# The parts of a recipe that Recipe.derive can run in bf16, by the operand slots they are
# (the words of every derived recipe's name and of the precision config's bf16 modes).
BF16_PARTS: dict[str, tuple[str, ...]] = {
    # fprop: the forward GEMM's two operands.
    "forward": SLOT_PAIRS["fprop"],
    # dgrad and wgrad: the backward GEMMs' four operands (straight-through gradients).
    "backward": SLOT_PAIRS["dgrad"] + SLOT_PAIRS["wgrad"],
    # The forward GEMM's activations only (a weight-only inference recipe).
    "inputs": ("fprop_x",),
}
# What separates a derived recipe's base name from its bf16 parts ("nvfp4+bf16_forward").
DERIVED_MARK = "+bf16_"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """Formats of the six GEMM operands of a linear layer. Frozen, hashable, JSON-able.

    ``make_dot_general`` treats the lhs of a ``dot_general`` as the activation ``X`` and
    the rhs as the weight ``W``.
    """

    # Preset name or a user label (reports and checkpoints show it).
    name: str = "custom"
    # fprop Y = X W: the activations X, blocks along K.
    fprop_x: OperandSpec = BF16
    # fprop Y = X W: the weight W, blocks along K.
    fprop_w: OperandSpec = BF16
    # dgrad dX = dY W^T: the output gradient dY, blocks along N.
    dgrad_dy: OperandSpec = BF16
    # dgrad dX = dY W^T: the weight, blocks along N. When equal to ``fprop_w`` and
    # transpose-invariant (16x16 tiles, per-tensor, bf16) fprop's quantized W is reused.
    dgrad_w: OperandSpec = BF16
    # wgrad dW = X^T dY: the activations, blocks along M (tokens).
    wgrad_x: OperandSpec = BF16
    # wgrad dW = X^T dY: the output gradient, blocks along M (tokens).
    wgrad_dy: OperandSpec = BF16
    # Seed of the fixed random sign vector of the Hadamard transform (not per step).
    hadamard_seed: int = 0
    # Tensor-scale source: "current" (the operand's own amax, every call) or "delayed"
    # (Transformer Engine's delayed scaling: the amax of earlier steps, kept in an amax
    # history that the caller carries; see microscale.ops.delayed). Delayed scaling
    # needs a per-tensor scale on every quantized operand (FP8 per-tensor, NVFP4's
    # global scale), not MX formats.
    scaling: Scaling = "current"
    # Steps of amax history kept per operand (delayed scaling).
    amax_history_len: int = 16
    # How the history becomes the amax in use: "max" over the window, or "most_recent".
    amax_compute: Literal["max", "most_recent"] = "max"

    def __post_init__(self):
        for slot in SLOTS:
            if not isinstance(getattr(self, slot), OperandSpec):
                raise TypeError(
                    f"Recipe.{slot} must be an OperandSpec, "
                    f"got {type(getattr(self, slot)).__name__}"
                )
        if self.scaling not in ("current", "delayed"):
            raise ValueError(
                f"recipe {self.name!r}: unknown scaling {self.scaling!r}; "
                "expected 'current' or 'delayed'"
            )
        if self.amax_compute not in ("max", "most_recent"):
            raise ValueError(
                f"recipe {self.name!r}: unknown amax_compute "
                f"{self.amax_compute!r}; expected 'max' or 'most_recent'"
            )
        if int(self.amax_history_len) < 1:
            raise ValueError(
                f"recipe {self.name!r}: amax_history_len="
                f"{self.amax_history_len!r}; expected an int >= 1"
            )
        if self.scaling == "delayed":
            bad = [
                slot
                for slot, s in self.operands().items()
                if s.quantized and not s.spec.has_tensor_scale
            ]
            if bad:
                raise ValueError(
                    f"recipe {self.name!r}: delayed scaling needs a per-tensor "
                    f"scale on every quantized operand; {bad} use "
                    f"{sorted({getattr(self, b).format for b in bad})}, which "
                    "have block scales only"
                )
        for gemm, (a, b) in self.gemms().items():
            if a.hadamard != b.hadamard:
                raise ValueError(
                    f"recipe {self.name!r}: the two {gemm} operands need the same "
                    f"hadamard size (got {a.hadamard} and {b.hadamard}); the "
                    "rotation only cancels when both sides are rotated"
                )

    def gemms(self) -> dict[str, tuple[OperandSpec, OperandSpec]]:
        """{gemm: (lhs spec, rhs spec)} in the order fprop, dgrad, wgrad."""
        return {gemm: (getattr(self, a), getattr(self, b)) for gemm, (a, b) in SLOT_PAIRS.items()}

    def operands(self) -> dict[str, OperandSpec]:
        return {slot: getattr(self, slot) for slot in SLOTS}

    @property
    def quantized(self) -> bool:
        """False when every operand is bf16 (the reference recipe)."""
        return any(s.quantized for s in self.operands().values())

    @property
    def needs_key(self) -> bool:
        """True when some operand uses stochastic rounding (a PRNG key is required)."""
        return any(s.stochastic for s in self.operands().values())

    @property
    def delayed(self) -> bool:
        """True when tensor scales come from an amax history (needs ``state=``)."""
        return self.scaling == "delayed" and self.quantized

    @property
    def reuses_fprop_w(self) -> bool:
        """dgrad uses fprop's quantized W (identical values; DESIGN: 2-D weights)."""
        return self.dgrad_w == self.fprop_w and self.fprop_w.transpose_invariant

    def replace(self, **changes) -> Recipe:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "hadamard_seed": self.hadamard_seed,
            "scaling": self.scaling,
            "amax_history_len": self.amax_history_len,
            "amax_compute": self.amax_compute,
        }
        d.update({slot: spec.to_dict() for slot, spec in self.operands().items()})
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        _check_keys(cls, d)
        d = dict(d)
        for slot in SLOTS:
            if slot in d and not isinstance(d[slot], OperandSpec):
                d[slot] = OperandSpec.from_dict(d[slot])
        return cls(**d)

    # ---- presets ---------------------------------------------------------------------
    @classmethod
    def bf16(cls) -> Recipe:
        """The reference: bf16 operands, float32 accumulation, nothing quantized."""
        return cls(name="bf16")

    @classmethod
    def fp8(
        cls,
        *,
        grad_format: str = "fp8_e5m2",
        scaling: Scaling = "current",
        amax_history_len: int = 16,
        name: str = "fp8",
    ) -> Recipe:
        """Per-tensor scaling (current, or delayed with an amax history): E4M3 forward,
        ``grad_format`` for dY."""
        fwd = OperandSpec(format="fp8_e4m3")
        grad = OperandSpec(format=grad_format)
        return cls(
            name=name,
            fprop_x=fwd,
            fprop_w=fwd,
            dgrad_dy=grad,
            dgrad_w=fwd,
            wgrad_x=fwd,
            wgrad_dy=grad,
            scaling=scaling,
            amax_history_len=amax_history_len,
        )

    @classmethod
    def mx(
        cls,
        fmt: str,
        *,
        rht: int | None = None,
        stochastic_rounding: bool = False,
        fwd_only: bool = False,
        name: str | None = None,
    ) -> Recipe:
        """An MX format (1x32 blocks, E8M0 scales) in all three GEMMs; optionally a
        Hadamard of size ``rht`` on the wgrad operands and SR on dY (Tseng et al.)."""
        fwd = OperandSpec(format=fmt)
        dy = OperandSpec(format=fmt, rounding="stochastic" if stochastic_rounding else "nearest")
        wx = OperandSpec(format=fmt, hadamard=rht)
        wdy = dataclasses.replace(dy, hadamard=rht)
        r = cls(
            name=name or fmt,
            fprop_x=fwd,
            fprop_w=fwd,
            dgrad_dy=dy,
            dgrad_w=fwd,
            wgrad_x=wx,
            wgrad_dy=wdy,
        )
        return r.forward_only() if fwd_only else r

    @classmethod
    def nvfp4(
        cls,
        *,
        rht: bool = True,
        stochastic_rounding: bool = True,
        weight_2d: bool = True,
        fwd_only: bool = False,
        name: str = "nvfp4",
    ) -> Recipe:
        """NVIDIA's NVFP4 training recipe (docs/design.md#the-three-gemms), each element
        switchable."""
        fmt = "nvfp4"
        block = get_format(fmt).block_size
        assert block is not None  # NVFP4 is block-scaled
        x = OperandSpec(format=fmt)
        w = OperandSpec(format=fmt, block_shape=(block, block) if weight_2d else None)
        sr: Rounding = "stochastic" if stochastic_rounding else "nearest"
        h = block if rht else None
        r = cls(
            name=name,
            fprop_x=x,
            fprop_w=w,
            dgrad_dy=OperandSpec(format=fmt, rounding=sr),
            dgrad_w=w,
            wgrad_x=OperandSpec(format=fmt, hadamard=h),
            wgrad_dy=OperandSpec(format=fmt, rounding=sr, hadamard=h),
        )
        return r.forward_only() if fwd_only else r

    def forward_only(self) -> Recipe:
        """This recipe's fprop; dgrad and wgrad in bf16 (the name kept: how the presets
        ``nvfp4_fwd_only`` and ``mxfp8_fwd_only`` are built)."""
        slots: dict[str, Any] = dict.fromkeys(BF16_PARTS["backward"], BF16)
        return dataclasses.replace(self, **slots)

    def derive(self, *, bf16: str | tuple[str, ...]) -> Recipe:
        """This recipe with the operands of the ``bf16`` parts (:data:`BF16_PARTS`:
        ``"forward"``, ``"backward"``, ``"inputs"``) in bf16: the one way microscale derives
        a recipe from another, and so the one naming scheme of derived recipes,
        ``"<base>+bf16_<part>[_<part>...]"`` (parts in :data:`BF16_PARTS` order). Deriving
        from a derived recipe adds to its parts: ``nvfp4+bf16_backward`` with ``forward``
        is ``nvfp4+bf16_forward_backward``."""
        parts = (bf16,) if isinstance(bf16, str) else tuple(bf16)
        bad = [p for p in parts if p not in BF16_PARTS]
        if bad or not parts:
            raise ValueError(
                f"Recipe.derive(bf16={bf16!r}): expected one or more of {list(BF16_PARTS)}"
            )
        base, _, had = self.name.partition(DERIVED_MARK)
        named = set(parts) | set(had.split("_") if had else ())
        slots = {slot for p in parts for slot in BF16_PARTS[p]}
        name = base + DERIVED_MARK + "_".join(p for p in BF16_PARTS if p in named)
        in_bf16: dict[str, Any] = dict.fromkeys(sorted(slots), BF16)
        return dataclasses.replace(self, name=name, **in_bf16)


def _check_keys(cls, d) -> None:
    if not isinstance(d, dict):
        raise TypeError(f"{cls.__name__}.from_dict expects a dict, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(d) - names)
    if bad:
        raise ValueError(f"unknown {cls.__name__} field(s) {bad}; expected some of {sorted(names)}")


def _presets() -> dict[str, Recipe]:
    table = [
        Recipe.bf16(),
        Recipe.fp8(),
        Recipe.fp8(grad_format="fp8_e4m3", name="fp8_e4m3"),
        Recipe.fp8(scaling="delayed", name="fp8_delayed"),
        Recipe.mx("mxfp8"),
        Recipe.mx("mxfp8", fwd_only=True, name="mxfp8_fwd_only"),
        Recipe.nvfp4(),
        Recipe.nvfp4(rht=False, name="nvfp4_no_rht"),
        Recipe.nvfp4(stochastic_rounding=False, name="nvfp4_no_sr"),
        Recipe.nvfp4(weight_2d=False, name="nvfp4_1d"),
        Recipe.nvfp4(fwd_only=True, name="nvfp4_fwd_only"),
        Recipe.nvfp4(rht=False, stochastic_rounding=False, weight_2d=False, name="nvfp4_rne_1d"),
        Recipe.mx("mxfp4"),
        Recipe.mx("mxfp4", rht=32, stochastic_rounding=True, name="mxfp4_rht_sr"),
    ]
    return {r.name: r for r in table}


RECIPES: dict[str, Recipe] = _presets()

# A recipe as layers and rules accept it: a preset name or a Recipe.
RecipeLike = str | Recipe


def recipe_name(recipe: RecipeLike | None) -> str | None:
    """The display name of a recipe (a name string passes through)."""
    if recipe is None or isinstance(recipe, str):
        return recipe
    return recipe.name


def list_recipes() -> list[str]:
    """Names accepted by :func:`get_recipe`."""
    return list(RECIPES)


def get_recipe(recipe: str | Recipe | dict) -> Recipe:
    """A preset by name, a :class:`Recipe` passed through, or one from its ``to_dict()``."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, dict):
        return Recipe.from_dict(recipe)
    if isinstance(recipe, str) and recipe in RECIPES:
        return RECIPES[recipe]
    raise ValueError(
        f"unknown recipe {recipe!r}; expected one of {list_recipes()}, "
        "a Recipe or a Recipe.to_dict() dict"
    )
