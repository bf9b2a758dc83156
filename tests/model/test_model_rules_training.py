"""rules_for_training: how a searched allocation trains (QAT forward-only, or full recipes)."""

import pytest

from microscale.model import PrecisionRules, rules_for_training
from microscale.ops import get_recipe
from microscale.ptq import ptq_recipe

# (recipe in the rules, mode, expected recipe: a preset name, or "same")
TABLE = [
    (ptq_recipe("nvfp4"), "forward", "same"),          # a PTQ recipe is forward-only already
    (ptq_recipe("nvfp4"), "full", "nvfp4"),
    (ptq_recipe("fp8_e4m3"), "full", "fp8_e4m3"),
    (ptq_recipe("mxfp8", activations=True), "full", "mxfp8"),
    (ptq_recipe("mxfp4"), "full", "mxfp4"),
    ("nvfp4", "forward", "nvfp4_fwd_only"),             # the backward pass goes to bf16
    ("mxfp8", "forward", "mxfp8_fwd_only"),
    ("nvfp4", "full", "same"),                          # already a training recipe
    ("bf16", "forward", "same"),
    ("bf16", "full", "same"),
    ("nvfp4", "as_written", "same"),
    (ptq_recipe("nvfp4"), "as_written", "same"),
]


def _ops(recipe):
    r = get_recipe(recipe)
    return r.operands(), r.hadamard_seed, r.scaling


@pytest.mark.parametrize("recipe, mode, expected", TABLE)
def test_table(recipe, mode, expected):
    rules = PrecisionRules(rules=((r"layers\.0\..*", recipe),), default="bf16")
    got = rules_for_training(rules, mode).resolve("layers.0.attn.q_proj")
    want = recipe if expected == "same" else expected
    assert _ops(got) == _ops(want)  # the six operand formats, as the preset defines them
    if expected != "same":
        assert get_recipe(got).name == expected
    assert rules_for_training(rules, mode).resolve("layers.1.attn.q_proj") == "bf16"


def test_forward_mode_leaves_no_quantized_backward_operand():
    rules = PrecisionRules(rules=((r"layers\.0\..*", "fp8"),), default="nvfp4")
    out = rules_for_training(rules, "forward")
    for path in ("layers.0.mlp.up_proj", "layers.1.mlp.up_proj"):
        r = get_recipe(out.resolve(path))
        assert r.quantized and r.fprop_w.quantized
        assert not any(s.quantized for s in (r.dgrad_dy, r.dgrad_w, r.wgrad_x, r.wgrad_dy))


def test_bad_mode():
    with pytest.raises(ValueError, match="mode='both'"):
        rules_for_training(PrecisionRules(), "both")
