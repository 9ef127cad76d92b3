import os
import sys
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Before JAX's CPU client starts: enough threads in its pool for the Mosaic GPU interpreter, whose
# warpgroups block pool threads in barrier waits (see sonic_jax.backends.INTERPRETER_MIN_CPU_THREADS;
# with the 2 threads of a 2-core machine a layer test hung about one run in eight).
os.environ.setdefault("PJRT_NPROC", "16")


def pytest_collection_modifyitems(config, items):
  import jax
  on_gpu = jax.default_backend() == "gpu"
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords and not on_gpu:
      item.add_marker(skip)


@pytest.fixture
def rng(request):
  # Fresh inputs per test case, reproducible from the test's name.
  seed = zlib.crc32(request.node.nodeid.encode())
  return np.random.default_rng(seed)
