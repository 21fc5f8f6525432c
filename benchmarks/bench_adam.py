"""The offloaded update's AdamW: the fused C pass against the NumPy steps, on the same pieces, one thread.

    python benchmarks/bench_adam.py                      # 4M elements, fp16 grads and params
    python benchmarks/bench_adam.py --elements 1M --precision bf16 --repeats 9

Both update the same fp32 master, m and v from the same storage-dtype gradient
and write the params in the storage dtype: the C pass (runtime/csrc/adam.c:
widen, scale, AdamW and cast in one pass over each 512-element block) and
``AdamW.update_tile``'s NumPy fallback (the engine's RAM steps: widen, scale,
eight elementwise AdamW passes, cast). The two are timed in alternation,
``--repeats`` times each, and the median of each is reported as elements per
second and bytes touched per second (master, m, v read and written, the
gradient read and the params written: 28 B per element at 2-byte storage),
with the ratio. First they are checked to give the same bits.

What it is not: a disk benchmark (the offloaded step: benchmarks/bench_offload.py).
"""
import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from ringzero.runtime import optim  # noqa: E402
from ringzero.runtime.optim import AdamConfig, AdamW  # noqa: E402
from ringzero.runtime.state import storage_dtype  # noqa: E402
from ringzero.sizes import parse_size  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", default="4M", help="elements per piece (default 4M)")
    ap.add_argument("--precision", default="fp16", choices=("fp16", "bf16", "fp32"))
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)
    if not optim.HAVE_C:
        print("bench_adam: ringzero.runtime._adam was not built (no compiler at install?): nothing to compare",
              file=sys.stderr)
        return 2
    n = parse_size(a.elements)
    sd = storage_dtype(a.precision)
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = (rng.standard_normal(n) * 1e-2).astype(sd)
    runs = ((0, n // 2, True), (n // 2, None, False))
    state = {k: [p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32), np.empty(n, sd)] for k in "cn"}
    opts = {k: AdamW(AdamConfig(), n, np) for k in "cn"}

    def once(k):
        o = opts[k]
        o.begin_step()
        t0 = time.perf_counter()
        o.update_tile(*state[k][:3], grads, np.float32(0.5), 1e-3, runs, state[k][3], fused=k == "c")
        return time.perf_counter() - t0

    for k in "cn":
        once(k)
    same = all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(state["c"], state["n"]))
    times = {"c": [], "n": []}
    for _ in range(a.repeats):
        for k in "cn":
            times[k].append(once(k))
    same &= all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(state["c"], state["n"]))
    per = 24 + 2 * np.dtype(sd).itemsize
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(f"AdamW on {n:,} elements, {a.precision} grads and params, one thread, median of {a.repeats} "
          f"(bitwise equal: {'yes' if same else 'NO'})")
    for k, name in (("c", "fused C pass"), ("n", "NumPy steps")):
        print(f"  {name:<14} {med[k] * 1e3:9.2f} ms   {n / med[k] / 1e6:8.1f} M elements/s   "
              f"{n * per / med[k] / 1e9:6.2f} GB/s touched")
    print(f"  fused / NumPy throughput: {med['n'] / med['c']:.2f}x")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
