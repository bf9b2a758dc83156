#!/usr/bin/env bash
# GPU readiness check: everything worth knowing from a few minutes on one GPU (H200:
# FP8 tensor cores, no FP4), written under $OUT. On a machine without a GPU every part
# that needs one is skipped with a line saying so, and the script still runs to the end
# (CI runs it that way: tests/plan/test_gpu_check.py).
#
#   OUT=/tmp/gpu benchmarks/gpu_check.sh            # PYTHON=... to pick the interpreter
#
# Parts (each under its own time limit, so the whole stays under ~8 minutes on an H200):
#   1. device.txt        -- jax devices, compute capability, which recipes run natively
#   2. gpu_tests.txt     -- every GPU-only test (they skip on CPU)
#   3. fp8_native.json   -- native FP8 GEMMs (cc >= 8.9) vs the emulated path, bit by bit
#   4. linear.txt        -- benchmarks/linear.py: emulated NVFP4 / bf16, native FP8 / bf16
#   5. train.txt         -- benchmarks/train.py on the tiny preset, same ratios per step
#   6. compare/          -- one short `microscale compare` (bf16, fp8, nvfp4; 60 steps)
# summary.txt lists each part with ok / skipped (why) / failed (exit code).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
PY="${PYTHON:-python}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)/src"
export MICROSCALE_CACHE="${MICROSCALE_CACHE:-$OUT/cache}"

note() { echo "$1: $2" | tee -a "$SUMMARY"; }
part() {  # part NAME SECONDS OUTFILE CMD...
  local name="$1" limit="$2" file="$3"; shift 3
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$file" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then note "$name" "ok ($((SECONDS - t0))s) -> $file"
  else note "$name" "failed (exit $rc after $((SECONDS - t0))s; 124 = time limit) -> $file"; fi
}

"$PY" - > "$OUT/device.txt" 2>&1 <<'PYEOF'
import jax
from microscale.ops import backend, get_recipe, native_supported
print("jax", jax.__version__, "devices", jax.devices())
print("compute capability", backend.device_capability())
for r in ("fp8", "mxfp8", "nvfp4"):
    print(f"{r}: native={native_supported(get_recipe(r))}")
PYEOF
cat "$OUT/device.txt"
CC=$("$PY" -c "from microscale.ops import backend; c = backend.device_capability(); print('' if c is None else '%d%d' % c)" 2>/dev/null)
if [ -z "$CC" ]; then
  note device "no NVIDIA GPU (compute capability: none); GPU parts skipped"
else
  note device "GPU with compute capability ${CC:0:-1}.${CC: -1}"
fi

# 2. GPU-only tests: everything that skips without a GPU (they report as skipped on CPU).
part gpu_tests 240 gpu_tests.txt "$PY" -m pytest -q -p no:cacheprovider -rs \
  tests/ops/test_ops_backend.py -k "on_device or probe"

# 3. Native FP8 vs emulated, bit-compared (needs compute capability >= 8.9).
if [ -n "$CC" ] && [ "$CC" -ge 89 ]; then
  part fp8_native 120 fp8_native.json "$PY" - <<'PYEOF'
import json
import jax, numpy as np
from microscale.ops import qdot
kx, kw, kd = jax.random.split(jax.random.key(0), 3)
out = {}
for m, k, n in ((256, 512, 384), (2048, 4096, 4096)):
    x = jax.random.normal(kx, (m, k)) * 3
    w = jax.random.normal(kw, (k, n)) / 8
    dy = jax.random.normal(kd, (m, n))
    def run(backend):
        f = jax.jit(lambda x, w, dy: (lambda y, pb: (y,) + pb(dy))(
            *jax.vjp(lambda x, w: qdot(x, w, "fp8", backend=backend), x, w)))
        return [np.asarray(a, np.float32) for a in f(x, w, dy)]
    nat, emu = run("native"), run("emulated")
    res = {}
    for name, a, b in zip(("y", "dx", "dw"), nat, emu):
        res[name] = {"bit_equal_fraction": float(np.mean(a.view(np.uint32) == b.view(np.uint32))),
                     "max_abs_diff": float(np.max(np.abs(a - b))),
                     "max_rel_diff": float(np.max(np.abs(a - b)) / np.max(np.abs(b)))}
    out[f"{m}x{k}x{n}"] = res
print(json.dumps(out, indent=2))
PYEOF
else
  note fp8_native "skipped (needs an NVIDIA GPU with compute capability >= 8.9)"
fi

if [ -n "$CC" ]; then
  # 4./5. Benchmarks on the GPU: the fp8 recipe runs natively (backend auto), nvfp4 emulated
  # below compute capability 10.0.
  part linear 150 linear.txt "$PY" benchmarks/linear.py \
    --shapes 4096x4096x4096,2048x192x512 --recipes bf16,fp8,nvfp4 --reps 5
  part train 150 train.txt "$PY" benchmarks/train.py --presets tiny --recipes bf16,fp8,nvfp4 \
    --steps 10 --rounds 2
  # 6. One short compare run.
  part compare 150 compare.txt "$PY" -m microscale compare --runs bf16,fp8,nvfp4 --seeds 0 --quiet \
    steps=60 eval_every=30 "out=$OUT/compare"
else
  note linear "skipped (GPU timing; the CPU numbers are in docs/recipes.md)"
  note train "skipped (GPU timing)"
  note compare "skipped (a CPU compare takes minutes: the README's main command)"
fi
echo "---"
cat "$SUMMARY"
# Exit non-zero only when a part that ran failed.
! grep -q ": failed" "$SUMMARY"
