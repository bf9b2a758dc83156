"""What the integrity checks cost: CRC-32 + finiteness against checkpoint save/restore and
safetensors write/read, on a synthetic model state of N float32 parameters (params plus
AdamW's two moments, as a training checkpoint holds).

Side by side in one run, each the median of --repeats:
  * orbax save (synchronous) of the state, and the checksum pass microscale adds to it;
  * orbax restore of the state, and the verification pass (CRC-32 + finite check);
  * safetensors write / full read of the params, and their checksum / verification.
The ratios are the overhead of keeping the checks on.

Run:  python benchmarks/integrity.py [--params 16e6] [--repeats 5]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from microscale.export.tensorfile import TensorStore, write_safetensors
from microscale.integrity import check_finite, crc32_many, verify_crc32
from microscale.train.checkpoint import Checkpointer, abstract_like, host_leaves


def _median(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=16e6)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    n_layers, n = 8, int(a.params)
    per = n // n_layers
    key = jax.random.key(0)
    params = {
        f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (per,)) for i in range(n_layers)
    }
    state = {
        "params": params,
        "mu": jax.tree.map(jnp.zeros_like, params),
        "nu": jax.tree.map(jnp.ones_like, params),
    }
    jax.block_until_ready(state)
    root = Path(tempfile.mkdtemp(prefix="integrity-bench-"))
    rows = []
    try:
        step = iter(range(10**6))

        def save_only():
            ck = Checkpointer(root / "ck", keep=1, async_save=False)
            ck._mgr.save(
                next(step),
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({})
                ),
                force=True,
            )
            ck.close()

        rows.append(("orbax save (3 x params)", _median(save_only, a.repeats)))
        rows.append(
            ("  + checksums at save", _median(lambda: crc32_many(host_leaves(state)), a.repeats))
        )
        ck = Checkpointer(root / "ck2", keep=1, async_save=False)
        ck.save(1, state, {"step": 1})
        ck.wait()
        sums = crc32_many(host_leaves(state))

        def restore_only():
            return ck._mgr.restore(
                1,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_like(state)),
                    meta=ocp.args.JsonRestore(),
                ),
            )

        rows.append(("orbax restore", _median(restore_only, a.repeats)))
        restored = restore_only()["state"]

        def verify():
            host = host_leaves(restored)
            verify_crc32(host, sums, where="bench")
            check_finite(host.items(), where="bench")

        rows.append(("  + verification at restore", _median(verify, a.repeats)))
        ck.close()

        host = {k: np.asarray(v) for k, v in params.items()}
        st = root / "m.safetensors"
        rows.append(
            (
                "safetensors write (params, with CRC)",
                _median(lambda: write_safetensors(st, host), a.repeats),
            )
        )
        rows.append(("  of which checksums", _median(lambda: crc32_many(host), a.repeats)))

        def read_all():
            s = TensorStore(st)
            for k in s.names():
                np.asarray(s.get(k)).sum()  # verified on first get

        def read_raw():
            s = TensorStore(st)
            for k in s.names():
                s._verified.add(k)  # skip verification: the plain read
                np.asarray(s.get(k)).sum()

        rows.append(("safetensors read + use, unverified", _median(read_raw, a.repeats)))
        rows.append(("safetensors read + use, verified", _median(read_all, a.repeats)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mb = n * 4 / 2**20
    print(f"{n / 1e6:.0f}M float32 parameters ({mb:.0f} MiB; checkpoint state {3 * mb:.0f} MiB)")
    print("| what | ms |")
    print("|---|---:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} |")
    r = dict(rows)
    print(
        f"save overhead {r['  + checksums at save'] / r['orbax save (3 x params)']:.2f}x of "
        f"the save; restore overhead "
        f"{r['  + verification at restore'] / r['orbax restore']:.2f}x of the restore; "
        f"safetensors read {r['safetensors read + use, verified'] / r['safetensors read + use, unverified']:.2f}x"
    )


if __name__ == "__main__":
    main()
