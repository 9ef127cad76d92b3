"""The suite's shared setup (docs/testing.md): on a CPU, enough threads for the Mosaic GPU
interpreter, one compilation cache for the run, unoptimized XLA compiles and the GPU-only tests
skipped; the tests marked `slow` scheduled first; the absl flags a test defines removed after
it; an `rng` fixture seeded from each test's name."""

import importlib
import os
import shutil
import sys
import tempfile
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Before JAX's CPU client starts: enough threads in its pool for the Mosaic GPU interpreter, whose
# warpgroups block pool threads in barrier waits (see sonic_jax.interpret.MIN_CPU_THREADS: with
# the 2 threads of a 2-core machine a layer test can hang).
os.environ.setdefault("PJRT_NPROC", "16")


def pytest_configure(config):
  """On a machine without a GPU, one persistent compilation cache for the whole run, shared by
  the xdist workers and the scripts that tests start (they inherit the environment): most of a
  CPU test's time is XLA compiling, and many tests compile the same programs (docs/testing.md).
  The directory is the run's own and is removed at its end, so nothing carries over between runs.
  A JAX_COMPILATION_CACHE_DIR set by the caller is left alone."""
  if hasattr(config, "workerinput") or shutil.which("nvidia-smi"):
    return  # an xdist worker (the controller set it up) or a GPU machine
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return
  config._sonic_jax_cache_dir = tempfile.mkdtemp(prefix="sonic_jax_test_compilation_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = config._sonic_jax_cache_dir
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_unconfigure(config):
  cache_dir = getattr(config, "_sonic_jax_cache_dir", None)
  if cache_dir:
    shutil.rmtree(cache_dir, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
  """Off a GPU, the GPU-only tests skip. The tests marked `slow` run first: a long test that
  starts late keeps one xdist worker busy after the others have finished (pyproject.toml's
  `--dist=worksteal` moves the short tests to whichever worker is free)."""
  import jax
  on_gpu = jax.default_backend() == "gpu"
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords and not on_gpu:
      item.add_marker(skip)
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the same order


@pytest.fixture(autouse=True)
def _xla_effort(request):
  """Off a GPU, the programs a test compiles in this process have most XLA optimizations off:
  the tests run tiny shapes, where compiling is most of the time (a quarter less for the suite;
  docs/testing.md). A test marked `xla_optimized` (float32 results that XLA's unoptimized code
  moves past their tolerance) compiles optimized, with jit's in-memory caches cleared before and
  after it, since the option is not part of their key (the persistent cache's it is): no test
  runs a program compiled under the other setting."""
  import jax
  if jax.default_backend() == "gpu":
    yield
    return
  optimized = request.node.get_closest_marker("xla_optimized") is not None
  before = jax.config.read("jax_disable_most_optimizations")
  if optimized:
    jax.clear_caches()
  jax.config.update("jax_disable_most_optimizations", not optimized)
  yield
  jax.config.update("jax_disable_most_optimizations", before)
  if optimized:
    jax.clear_caches()


@pytest.fixture(autouse=True)
def _absl_flags():
  """The absl flags a test defines (importing the example's scripts or a tool) are removed after
  it: other scripts define flags of the same names, and absl refuses a second definition in the
  worker that later imports one of them."""
  try:
    from absl import flags
    for module in ("absl.app", "absl.logging"):  # their own flags, defined as they load, stay
      importlib.import_module(module)
  except ImportError:
    yield
    return
  before = set(flags.FLAGS)
  yield
  for name in set(flags.FLAGS) - before:
    delattr(flags.FLAGS, name)


@pytest.fixture
def rng(request):
  # Fresh inputs per test case, reproducible from the test's name.
  seed = zlib.crc32(request.node.nodeid.encode())
  return np.random.default_rng(seed)
