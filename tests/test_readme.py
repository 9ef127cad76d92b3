"""The README's Python quickstarts and the docs' Python snippets run as written, each as a script
of its own, in a fresh process on the CPU (with four host devices, for the expert-parallel one),
and the README stays a user's page."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def _python_blocks(path=README):
  with open(path) as f:
    text = f.read()
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_is_short():
  with open(README) as f:
    lines = f.read().splitlines()
  assert len(lines) <= 200
  assert max(map(len, lines)) <= 400
  # the functional op, the Flax layer, expert parallelism, a model family's layer from its config
  assert len(_python_blocks()) == 4


# Runs each script named on its command line as its own __main__, in order, and reports the ones
# that raised: the quickstarts share one process's imports and compiled programs.
_RUN_EACH = """
import runpy, sys, traceback
failed = []
for path in sys.argv[1:]:
  try:
    runpy.run_path(path, run_name="__main__")
  except Exception:
    traceback.print_exc()
    failed.append(path)
sys.exit(f"failed: {failed}" if failed else 0)
"""


@pytest.mark.slow
def test_readme_quickstarts_and_docs_snippets_run(tmp_path):
  """Each quickstart and docs/ snippet as a script of its own, all in one fresh process (four CPU
  devices)."""
  docs = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
  blocks = _python_blocks() + [block for path in docs for block in _python_blocks(path)]
  assert len(blocks) > 4  # the docs have snippets too
  scripts = []
  for index, block in enumerate(blocks):
    scripts.append(tmp_path / f"snippet_{index}.py")
    scripts[-1].write_text(block)
  # XLA compiles unoptimized: the snippets run a few steps on tiny shapes, where compiling is
  # most of the time (the five 13 s against 17 s optimized, 2-core CPU).
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  done = subprocess.run([sys.executable, "-c", _RUN_EACH, *map(str, scripts)], cwd=tmp_path,
                        env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-4000:]


def test_subpackages_load_on_first_use():
  """`import sonic_jax` then `sonic_jax.layers.MoE` (and the other subpackages) works; an unknown
  attribute is still an AttributeError."""
  import sonic_jax  # the README names the layer sonic_jax.layers.MoE
  from sonic_jax.layers import MoE
  from sonic_jax.parallel import moe_all_gather
  assert sonic_jax.layers.MoE is MoE and sonic_jax.parallel.moe_all_gather is moe_all_gather
  assert "deepseek_v3" in sonic_jax.hf.FAMILIES
  with pytest.raises(AttributeError, match="no_such_name"):
    sonic_jax.no_such_name  # noqa: B018
