"""The top-level API stays what the README shows, whatever subpackages are imported."""

import importlib
import pkgutil

import microscale


def test_top_level_functions_survive_importing_every_subpackage():
    for mod in pkgutil.walk_packages(microscale.__path__, "microscale."):
        if not mod.name.startswith("microscale.cli") and not mod.name.endswith("__main__"):
            importlib.import_module(mod.name)
    for name in (
        "quantize",
        "dequantize",
        "fake_quantize",
        "qdot",
        "make_dot_general",
        "get_format",
        "get_recipe",
    ):
        assert callable(getattr(microscale, name)), name
    assert microscale.quantize is microscale.formats.quantize
