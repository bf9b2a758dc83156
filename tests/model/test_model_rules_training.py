"""rules_for_training: how a searched allocation trains (QAT: bf16 backward; or full recipes)."""

import pytest

from microscale.model import PrecisionRules, rules_for_training
from microscale.ops import get_recipe
from microscale.ptq import ptq_recipe

# (recipe in the rules, what runs in bf16, expected: "same", a preset name, or (the preset
# with the same operands, the derived recipe's name))
TABLE = [
    (ptq_recipe("nvfp4"), "backward", "same"),  # a PTQ recipe is forward-only already
    (ptq_recipe("nvfp4"), "nothing", "nvfp4"),
    (ptq_recipe("fp8_e4m3"), "nothing", "fp8_e4m3"),
    (ptq_recipe("mxfp8", activations=True), "nothing", "mxfp8"),
    (ptq_recipe("mxfp4"), "nothing", "mxfp4"),
    ("nvfp4", "backward", ("nvfp4_fwd_only", "nvfp4+bf16_backward")),  # backward to bf16
    ("mxfp8", "backward", ("mxfp8_fwd_only", "mxfp8+bf16_backward")),
    ("nvfp4", "nothing", "same"),  # already a training recipe
    ("bf16", "backward", "same"),
    ("bf16", "nothing", "same"),
    ("nvfp4", "as_written", "same"),
    (ptq_recipe("nvfp4"), "as_written", "same"),
]


def _ops(recipe):
    r = get_recipe(recipe)
    return r.operands(), r.hadamard_seed, r.scaling


@pytest.mark.parametrize("recipe, bf16, expected", TABLE)
def test_table(recipe, bf16, expected):
    rules = PrecisionRules(rules=((r"layers\.0\..*", recipe),), default="bf16")
    got = rules_for_training(rules, bf16).resolve("layers.0.attn.q_proj")
    want, name = (
        (recipe, None)
        if expected == "same"
        else (expected if isinstance(expected, tuple) else (expected, expected))
    )
    assert _ops(got) == _ops(want)  # the six operand formats, as the preset defines them
    if name is not None:
        assert get_recipe(got).name == name
    assert rules_for_training(rules, bf16).resolve("layers.1.attn.q_proj") == "bf16"


def test_bf16_backward_leaves_no_quantized_backward_operand():
    rules = PrecisionRules(rules=((r"layers\.0\..*", "fp8"),), default="nvfp4")
    out = rules_for_training(rules, "backward")
    for path in ("layers.0.mlp.up_proj", "layers.1.mlp.up_proj"):
        r = get_recipe(out.resolve(path))
        assert r.quantized and r.fprop_w.quantized
        assert not any(s.quantized for s in (r.dgrad_dy, r.dgrad_w, r.wgrad_x, r.wgrad_dy))


def test_bad_mode():
    with pytest.raises(ValueError, match="bf16='both'"):
        rules_for_training(PrecisionRules(), "both")
