"""One colour and marker per recipe, the same in every figure microscale draws.

``compare``'s ``convergence.png`` and ``gap.png``, the ``--sizes`` trend's ``scaling.png``
and quantize's ``pareto.png`` (whose uniform points are formats of the same names) all take
a run's colour from :data:`STYLES`, so a recipe is one colour wherever it appears, never
the next colour of a cycle that depends on what else was drawn.

The colours are the Okabe-Ito palette (distinguishable under the common colour-vision
deficiencies) for the baselines, then Paul Tol's "muted" hues for the NVFP4 ablations, no
two of one hue at two lightnesses; each ablation also has its own marker, and ``compare``
draws ablations dashed. A name not in the table (a recipe ``compare`` does not run) gets
:data:`OTHER`.
"""

from __future__ import annotations

import dataclasses

__all__ = ["OTHER", "STYLES", "Style", "style"]


@dataclasses.dataclass(frozen=True)
class Style:
    """How one recipe is drawn."""

    # A matplotlib colour ("#rrggbb").
    color: str
    # A matplotlib marker.
    marker: str


STYLES: dict[str, Style] = {
    # the baselines: Okabe-Ito
    "bf16": Style("#000000", "o"),
    "fp8": Style("#E69F00", "o"),
    "mxfp8": Style("#CC79A7", "o"),
    "nvfp4": Style("#0072B2", "o"),
    "mxfp4": Style("#009E73", "o"),
    "q8_0": Style("#D55E00", "o"),  # a GGUF format (quantize layout=gguf), no recipe
    # the NVFP4 ablations: Tol's muted hues, each with its own marker
    "nvfp4_no_rht": Style("#CC6677", "s"),
    "nvfp4_no_sr": Style("#999933", "^"),
    "nvfp4_1d": Style("#332288", "v"),
    "nvfp4_all_fp4": Style("#882255", "D"),
    "nvfp4_fwd_only": Style("#56B4E9", "P"),
    "nvfp4_late_bf16": Style("#DDCC77", "X"),
    "nvfp4_adaptive": Style("#777777", "<"),
    "nvfp4_warmup": Style("#44AA99", ">"),
}
# A name the table does not know.
OTHER = Style("#BBBBBB", "*")
# Format names that are a recipe's format (quantize's uniform points).
_ALIASES = {"fp8_e4m3": "fp8"}


def style(name: str) -> Style:
    """The style of recipe (or format) ``name``; :data:`OTHER` for a name not in the table."""
    return STYLES.get(_ALIASES.get(name, name), OTHER)
