"""Expert parallelism (sonic_jax.parallel, the layer's expert_parallel_axis) on 8 or 4 CPU
devices: equals the single-device op. Each script's docstring lists its checks
(`benchmarks/ep_bench.py` checks the schemes against one GPU on GPUs)."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(script, *args):
  # A fresh process: the CPU device count is fixed when JAX starts. XLA compiles with most of its
  # optimizations off: the scripts compare the sharded op with the single-device op, both compiled
  # so, in float64 on tiny shapes, where compiling is nearly all of the time.
  proc = subprocess.run([sys.executable, os.path.join(HERE, script), *args],
                        capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1"))
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


# Each scheme with plain top-K (the all-to-all also skewed: experts 5..7 get no token), token
# rounding both ways, family
# routers (groups and biases; Llama 4's input scaling) through both schemes; the exchanges do not
# depend on the router's mode, so not every product is run. One process for all: the schemes'
# cases share the single-device programs, and a scheme's cases its sharded ones.
CASES = {"all_to_all": ["random", "skew", "skew:nearest", "random:up", "random:llama4",
                        "random:deepseek_v4", "empty", "given_ids", "replicated", "data_axis",
                        "data_axis_bf16"],
         "all_gather": ["random", "skew:nearest", "random:deepseek_v3", "skew:llama4",
                        "random:deepseek_v4", "empty", "given_ids", "replicated", "data_axis",
                        "tuple_axis"]}


@pytest.mark.slow
def test_expert_parallel_matches_single_device():
  """2 and 8 shards (1 too with skewed top-K routing; one count with a family router or rounding),
  float64: output and the gradients of x, router, w1, w2, b1 (a case's third field: a token
  rounding mode, or a family router with router and selection biases, a router input and a
  per-expert scale, whose gradients are compared too; DeepSeek-V4's with a fixed selection),
  under shard_map's replication check; "empty": no tokens on any device; "given_ids": a given
  selection naming one expert twice for a token, axis_name as a list, and d = 0; "replicated": x
  replicated over the axis rather than split; "data_axis": a (data, ep) mesh, the expert weights
  replicated over data (in bfloat16 too); "tuple_axis": the experts over both,
  axis_name=("data", "ep")."""
  _run("ep_check.py", *(f"{scheme}:{case}" for scheme, cases in CASES.items() for case in cases))


@pytest.mark.slow
def test_capacity_drops_and_data_parallel_mesh():
  """Arguments the ops refuse by name; both schemes with a capacity that drops pairs (the
  all-to-all's against a model of its slots, the all-gather's against the single-device op, with
  softmax and with Llama 4's router), and a (data, ep) mesh under scan + checkpoint."""
  _run("ep_capacity_check.py")


@pytest.mark.slow
def test_flax_layer_matches_single_device():
  """The layer, both schemes (one process: they share the single-device references): under a
  user's shard_map; in a plain jit program under jax.set_mesh on a (data, ep) mesh, the layer
  adding its own shard_map; eagerly under set_mesh with unplaced parameters; inside a lax.scan;
  the all-gather scheme with a capacity. Then mixed axis types refused, and without expert
  parallelism: split expert weights refused, split operands of `moe`, `moe` vmapped over a split
  batch, the layer data parallel under set_mesh, the sequence-wise balance loss."""
  _run("ep_layer_check.py", "all_to_all", "all_gather")
