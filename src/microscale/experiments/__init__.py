"""Run sets over the trainer: ``compare`` (recipes, ablations, seeds, sizes), its paired
statistics (``stats``) and reports (``report``)."""

from microscale.experiments.compare import run_compare
from microscale.experiments.compare_config import CompareConfig
from microscale.experiments.report import render_markdown, write_report
from microscale.experiments.runs import ABLATIONS, BASELINES, RUNS

__all__ = [
    "ABLATIONS",
    "BASELINES",
    "RUNS",
    "CompareConfig",
    "render_markdown",
    "run_compare",
    "write_report",
]
