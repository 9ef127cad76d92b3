"""Expert parallelism (sonic_jax.parallel) on 8 CPU devices: equals the single-device op.

On CPU the all-to-all scheme's ragged transport runs through its emulation (XLA:CPU has no
ragged-all-to-all); `benchmarks/ep_bench.py` checks the native collective against one GPU."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(script, *args):
  # A fresh process: the CPU device count is fixed when JAX starts.
  proc = subprocess.run([sys.executable, os.path.join(HERE, script), *args],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


# Each scheme with skewed routing (experts 5..7 get no token), token rounding both ways; the
# transports do not depend on the router's mode, so not every product is run.
@pytest.mark.parametrize("scheme,routing,rounding", [
    ("all_to_all_dense", "random", None), ("all_to_all_dense", "skew", None),
    ("all_to_all_dense", "random", "up"), ("all_to_all_ragged", "skew", "nearest"),
    ("all_gather", "skew", "nearest"),
    # family routers (groups and biases; Llama 4's input scaling) through both schemes
    ("all_gather", "random", "deepseek_v3"), ("all_to_all_dense", "random", "llama4"),
    ("all_gather", "skew", "llama4")])
def test_expert_parallel_matches_single_device(scheme, routing, rounding):
  """2 and 8 shards (and 1 with skewed routing), float64: output and the gradients of x, router,
  w1, w2, b1 (the third argument: a token rounding mode, or a family router with router and
  selection biases)."""
  _run("ep_check.py", scheme, routing, *([rounding] if rounding else []))


def test_all_to_all_capacity_drops_and_data_parallel_mesh():
  _run("ep_capacity_check.py")


@pytest.mark.parametrize("scheme", ["all_to_all", "all_gather"])
def test_flax_layer_with_expert_parallel_axis_matches_single_device(scheme):
  _run("ep_layer_check.py", scheme)


@pytest.mark.parametrize("scheme", ["all_to_all", "all_gather"])
def test_flax_layer_under_set_mesh_matches_single_device(scheme):
  """No user shard_map: a jit program under jax.set_mesh on a (data, ep) mesh."""
  _run("ep_mesh_layer_check.py", scheme)


@pytest.mark.parametrize("scheme", ["all_to_all", "all_gather"])
def test_flax_layer_runs_eagerly_under_set_mesh_with_unplaced_parameters(scheme):
  _run("ep_eager_check.py", scheme)
