"""``--no-compile-cache`` turns JAX's persistent compilation cache off, even where
``JAX_COMPILATION_CACHE_DIR`` names a folder (JAX reads the variable on its own, so not
turning the cache on is not enough). Each case is a fresh process: JAX decides whether to
use the cache once per process, at the first compilation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from microscale.cli import quantize as quantize_cli
from microscale.cli import train as train_cli

PROBE = """
import argparse, sys
import jax, jax.numpy as jnp
from microscale.cli import {module} as cli
parser = argparse.ArgumentParser()
cli.add_arguments(parser)
args, _ = parser.parse_known_args(sys.argv[1:])
from microscale.cli.args import use_compile_cache
use_compile_cache(args)
print(float(jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.float32(2.0))))
"""


@pytest.mark.parametrize("module", [train_cli, quantize_cli], ids=["train", "quantize"])
@pytest.mark.parametrize("off", [False, True], ids=["default", "no-compile-cache"])
def test_no_compile_cache_writes_nothing_to_the_env_cache(module, off, tmp_path, hang_guard_s):
    cache = tmp_path / "jax-cache"
    cache.mkdir()
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "JAX_PLATFORMS": "cpu",
    }
    code = PROBE.format(module=module.__name__.rsplit(".", 1)[1])
    argv = [sys.executable, "-c", code, *(["--no-compile-cache"] if off else [])]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=hang_guard_s)
    assert proc.returncode == 0, proc.stderr
    entries = list(cache.iterdir())
    if off:
        assert entries == [], f"--no-compile-cache left {entries} in the cache"
    else:  # the control: the same program is cached when the option is absent
        assert entries, "the probe's program was not cached: the test cannot see the option"
