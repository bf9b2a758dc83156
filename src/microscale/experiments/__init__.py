"""Run sets over the trainer: ``compare`` (recipes and ablations) and its reports."""

from microscale.experiments.compare import (
    ABLATIONS,
    BASELINES,
    RUNS,
    CompareConfig,
    render_markdown,
    run_compare,
    write_report,
)

__all__ = ["ABLATIONS", "BASELINES", "RUNS", "CompareConfig", "render_markdown", "run_compare",
           "write_report"]
