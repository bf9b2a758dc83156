"""Suite-wide settings: deterministic hypothesis examples (a CI run never flakes on a
new random example; run with HYPOTHESIS_PROFILE=explore to search afresh)."""

import os

from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))
