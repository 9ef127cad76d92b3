"""Checks the fused-gather variants of the up-projection on a GPU: each in a child process with a
time limit (a deadlocked kernel must not take the whole session), against the contiguous kernel.

  python3 benchmarks/gather_check.py [cp_async row_tma]   # exit 0 iff every variant is right
"""

import subprocess
import sys

CHILD = r'''
import sys, time
import jax, jax.numpy as jnp, numpy as np
from sonic_jax import activations as acts
from sonic_jax.layout import build_grouped_layout
from sonic_jax.mosaic_gpu import up_projection as up
from sonic_jax.mosaic_gpu.grouped_gemm import GroupedGemmConfig
impl = sys.argv[1]
T, d, n, E, K = 4096, 512, 256, 8, 2
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((T, d)), jnp.bfloat16)
w1 = jnp.asarray(rng.standard_normal((E, d, 2 * n)) / np.sqrt(d), jnp.bfloat16)
lay = build_grouped_layout(jnp.asarray(rng.integers(0, E, (T, K)), jnp.int32), E, 128)
act = acts.ACTIVATIONS["swiglu"]
cfg = up.UpProjectionConfig(GroupedGemmConfig(num_stages=4, gather_impl=impl))
t0 = time.time()
h, _ = jax.block_until_ready(up.up_projection(x, w1, None, lay, act, "concat", config=cfg))
print(impl, "first call", round(time.time() - t0, 1), "s", flush=True)
hc, _ = up.up_projection(x[lay.row_token], w1, None, lay, act, "concat", gather=False)
valid = np.asarray(lay.row_valid())
err = np.abs(np.asarray(h, np.float32)[valid] - np.asarray(hc, np.float32)[valid]).max()
print(impl, "max |gathered - contiguous| =", err, flush=True)
sys.exit(0 if err == 0 else 1)
'''


def main():
  ok = True
  for impl in sys.argv[1:] or ["cp_async", "row_tma"]:
    try:
      proc = subprocess.run([sys.executable, "-c", CHILD, impl], timeout=150, capture_output=True,
                            text=True)
      out = (proc.stdout + proc.stderr)[-2500:]
      print(out)
      ok &= proc.returncode == 0
    except subprocess.TimeoutExpired as e:
      print(impl, "TIMED OUT (deadlock?)", (e.stdout or b"")[-2000:])
      ok = False
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
