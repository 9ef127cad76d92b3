"""Expert parallelism (sonic_jax.parallel) on 8 CPU devices: equals the single-device op."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("routing,rounding", [("random", None), ("skew", None), ("random", "up"),
                                              ("skew", "nearest")])
def test_all_gather_expert_parallel_matches_single_device(routing, rounding):
  # A fresh process: the CPU device count is fixed when JAX starts.
  proc = subprocess.run([sys.executable, os.path.join(HERE, "ep_check.py"), routing]
                        + ([rounding] if rounding else []),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_flax_layer_with_expert_parallel_axis_matches_single_device():
  proc = subprocess.run([sys.executable, os.path.join(HERE, "ep_layer_check.py")],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
