"""The aggregation's gather-sum kernel (`sonic_jax.mosaic_gpu.gather_sum`) against a float64
reference, and the mosaic_gpu backend's aggregation against XLA's: interpreted on CPU (with race
detection), compiled on an sm90 GPU (-m gpu)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import export_for_h100
from oracle import rel_err
from sonic_jax import xla_backend
from sonic_jax.mosaic_gpu import gather_sum as gs
from test_mosaic_gpu import MODES, _cases_in_modes, _layout, kernel_mode


def _problem(rng, r, d, t, s, used):
  """rows (R, d) bfloat16 whose rows from `used` on are NaN (as rows no GEMM wrote may be: the
  sum must leave them out), pair rows with pairs routed nowhere (R and -1), weights."""
  rows = rng.standard_normal((r, d)).astype(np.float32)
  rows[used:] = np.nan
  pair_row = rng.integers(0, used, (t, s)).astype(np.int32)
  pair_row[rng.random((t, s)) < 0.1] = r
  pair_row[rng.random((t, s)) < 0.05] = -1
  weights = rng.uniform(0.1, 1.0, (t, s)).astype(np.float32)
  return jnp.asarray(rows, jnp.bfloat16), jnp.asarray(pair_row), jnp.asarray(weights)


# (R, d, T, S, config): S = 1 and not a power of two; pieces of a whole row and of part of one;
# views 256 and 128 columns wide; rings of 2 and 4 stages; one token (fewer items than CTAs).
SHAPES = [(300, 512, 37, 3, None), (64, 128, 9, 1, gs.GatherSumConfig(128, 2)),
          (200, 768, 21, 8, gs.GatherSumConfig(256, 4)), (90, 384, 13, 2, None),
          (40, 256, 1, 4, None)]
# Each shape in both output dtypes, interpreted in one, both among the shapes (the dtype is only the
# staging buffer's and the final cast's).
_DTYPE_INTERPRETED = (jnp.bfloat16, jnp.float32, jnp.float32, jnp.bfloat16, jnp.float32)
CASES = [(*shape, dtype) for shape in SHAPES for dtype in (jnp.bfloat16, jnp.float32)]
NAMES = "r,d,t,s,config,out_dtype"


@pytest.mark.parametrize(f"{NAMES},compiled", _cases_in_modes(
    NAMES, CASES, [i for i, c in enumerate(CASES)
                   if c[-1] != _DTYPE_INTERPRETED[SHAPES.index(c[:-1])]]))
def test_gather_sum_matches_reference(rng, compiled, out_dtype, r, d, t, s, config):
  if compiled:
    r, t = r * 40, t * 200
  rows, pair_row, weights = _problem(rng, r, d, t, s, used=r - 20)
  want = gs.reference(rows, pair_row, weights)
  with kernel_mode(compiled):
    got = jax.jit(lambda a, b, c: gs.gather_sum(a, b, c, out_dtype, config))(
        rows, pair_row, weights)
  got = np.asarray(got, np.float32)
  assert got.shape == (t, d) and np.all(np.isfinite(got))
  assert rel_err(got, want) < (1e-2 if out_dtype == jnp.bfloat16 else 1e-6)


def test_default_config_fills_the_ring():
  c = gs.default_config(4096, 16)
  assert (c.block_columns, c.num_stages) == (1024, 6)  # 32 KB stages
  assert gs.default_config(4096, 4).block_columns == 4096
  assert gs.default_config(768, 8).block_columns == 768
  # Row pieces stay at least 2 KB where d allows (32 KB stages would give 1 KB at S = 17 or 32).
  assert (gs.default_config(4096, 17).block_columns, gs.default_config(4096, 17).num_stages) == (
      1024, 4)
  assert gs.default_config(4096, 32).block_columns == 1024
  assert gs.default_config(384, 2).block_columns == 384
  for d in range(128, 32769, 128):
    for s in (1, 2, 8, 16, 17, 32):
      for out_itemsize in (2, 4):
        cfg = gs.default_config(d, s, 2, out_itemsize)
        assert d % cfg.block_columns == 0 and cfg.num_stages % 2 == 0, (d, s, cfg)
        assert cfg.block_columns % gs.view_columns(d) == 0, (d, s, cfg)
        assert gs.smem_bytes(cfg.block_columns, s, cfg.num_stages, 2, out_itemsize) <= (
            gs.SMEM_BYTES), (d, s, out_itemsize, cfg)


def test_gather_sum_names_what_it_does_not_take():
  rows = jnp.zeros((10, 192), jnp.bfloat16)
  pair_row = jnp.zeros((4, 2), jnp.int32)
  w = jnp.ones((4, 2), jnp.float32)
  assert "d=192" in gs.supports(rows, pair_row, w)
  assert "int32" in gs.supports(rows[:, :128], pair_row.astype(jnp.int16), w)
  assert "float32" in gs.supports(rows[:, :128].astype(jnp.float32), pair_row, w)
  assert "slots" in gs.supports(rows[:, :128], jnp.zeros((4, gs.MAX_SLOTS + 1), jnp.int32),
                                jnp.ones((4, gs.MAX_SLOTS + 1)))
  with pytest.raises(ValueError, match="gather-sum kernel: d=192"):
    gs.gather_sum(rows, pair_row, w, jnp.float32)
  with pytest.raises(ValueError, match="weights must be"):
    gs.gather_sum(rows[:, :128], pair_row, jnp.ones((4, 3)), jnp.float32)
  with pytest.raises(ValueError, match="block_columns=256 must divide d=384"):
    gs.gather_sum(jnp.zeros((10, 384), jnp.bfloat16), pair_row, w, jnp.float32,
                  gs.GatherSumConfig(256, 2))
  with pytest.raises(ValueError, match="num_stages must be even"):
    gs.GatherSumConfig(256, 3)


def test_gather_sum_lowers_for_sm90():
  """The kernel lowers to Mosaic GPU for an H100 from this machine (layout inference and the
  kernel's static checks, which the interpreter skips)."""
  if jax.default_backend() == "gpu":
    pytest.skip("CPU-side check")
  for r, d, t, s, config in [(300, 4096, 70, 16, None), (300, 4096, 70, 2, None)] + SHAPES:
    rows, pair_row, weights = _problem(np.random.default_rng(0), r, d, t, s, r - 20)
    for out in (jnp.bfloat16, jnp.float32):
      module = export_for_h100(
          lambda a, i, w, out=out, config=config: gs.gather_sum(a, i, w, out, config), rows,
          pair_row, weights)
      assert "mosaic_gpu" in module


# With extra pairs, interpret mode takes XLA's segment sum (no kernel runs): compiled only.
@pytest.mark.parametrize("compiled,extras", [
    pytest.param(False, False, id="interpret"),
    pytest.param(True, False, id="compiled", marks=pytest.mark.gpu),
    pytest.param(True, True, id="compiled-extras", marks=pytest.mark.gpu)])
def test_backend_aggregation_equals_xla(rng, compiled, extras, monkeypatch):
  """The mosaic_gpu backend's aggregation equals the XLA gather-sum on a grouped layout (skewed,
  an expert without pairs): weighted, by the kernel (its thresholds lowered), and unweighted (the
  XLA path: the kernel takes weights); with token rounding's extra pairs (a token with several,
  unused entries) folded into each token's slot 0 first."""
  import sonic_jax
  from sonic_jax.mosaic_gpu import backend as mosaic_backend
  calls = []
  kernel = mosaic_backend.gs.gather_sum
  monkeypatch.setattr(mosaic_backend.gs, "gather_sum",
                      lambda *a: (calls.append(1), kernel(*a))[1])
  config = sonic_jax.Config(gather_sum_kernel_min_slots=1, gather_sum_kernel_min_d=1)
  t, d, e, k = (40, 256, 4, 2) if not compiled else (4000, 1536, 16, 4)
  ids = rng.integers(0, e, (t, k))
  ids[: t // 2, 0] = 0
  ids[ids == e - 1] = 1
  extra = (jnp.asarray(np.r_[rng.integers(0, t, 5), 7, 7, 7], jnp.int32),
           jnp.asarray([0, 2, -1, 1, 0, 1, 2, 3], jnp.int32)) if extras else (None, None)
  layout = _layout(jnp.asarray(ids, jnp.int32), e, 128, *extra)
  rows = jnp.asarray(rng.standard_normal((layout.num_rows, d)), jnp.bfloat16)
  rows = jnp.where(layout.row_valid()[:, None], rows, jnp.nan)  # padding rows: NaN
  scores = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
  extra_scores = jnp.asarray(rng.uniform(0.1, 1.0, 8), jnp.float32) if extras else None
  for w, xw in ((scores, extra_scores), (None, None)):
    calls.clear()
    with kernel_mode(compiled):
      got = jax.jit(lambda r, lay, w=w, xw=xw: mosaic_backend.gather_sum(
          r, lay, w, jnp.float32, xw, config=config))(rows, layout)
    assert bool(calls) == (w is not None), calls  # the weighted sum by the kernel, only it
    want = xla_backend.gather_sum(rows, layout, w, jnp.float32, xw)
    assert np.all(np.isfinite(np.asarray(got)))
    # Compiled, the extra pairs are folded into a row of the (bfloat16) buffer first.
    assert rel_err(np.asarray(got), np.asarray(want)) < (4e-3 if compiled and extras else 1e-6)


def test_backend_aggregation_takes_the_kernel_where_the_config_says(monkeypatch):
  """By default the kernel runs the forward's weighted sum at S >= 16 slots and d >= 4096 only;
  the backward's unweighted sum, fewer slots and a narrower d stay XLA's; the Config's thresholds
  and switch move that line. Token rounding's extra pairs are folded into slot 0 first: no slot
  is added (without Pallas's Triton lowering, not at all: XLA's sum adds them)."""
  import sonic_jax
  from sonic_jax.mosaic_gpu import backend as mosaic_backend
  calls = []
  monkeypatch.setattr(mosaic_backend.gs, "gather_sum", lambda *a: calls.append(a) or "kernel")
  monkeypatch.setattr(mosaic_backend.xla_backend, "gather_sum", lambda *a: "xla")
  monkeypatch.setattr(mosaic_backend.extras_sum, "fold_extras",
                      lambda rows, slot_row, slot_weight, *_: (rows, slot_row, slot_weight))

  def choice(t, s, d, weighted=True, extras=False, config=sonic_jax.Config()):
    ids = jnp.asarray(np.arange(t * s).reshape(t, s) % 32, jnp.int32)
    extra = (jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32)) if extras else (None, None)
    layout = _layout(ids, 32, 128, *extra)
    rows = jax.ShapeDtypeStruct((layout.num_rows, d), jnp.bfloat16)
    w = jnp.ones((t, s), jnp.float32) if weighted else None
    return mosaic_backend.gather_sum(rows, layout, w, jnp.bfloat16, config=config)

  assert choice(8, 16, 4096) == "kernel"
  assert choice(8, 16, 4096, weighted=False) == "xla"
  assert choice(8, 8, 4096) == "xla"
  assert choice(8, 16, 2048) == "xla"
  assert choice(8, 16, 4096, extras=True) == "kernel"
  assert calls[-1][1].shape == (8, 16)
  assert choice(8, 15, 4096, extras=True) == "xla"
  assert choice(8, 0, 4096, extras=True) == "xla"  # extra pairs alone: no slot to fold into
  assert choice(8, 16, 4096, weighted=False, extras=True) == "xla"
  assert choice(8, 8, 2048, config=sonic_jax.Config(gather_sum_kernel_min_slots=8,
                                                    gather_sum_kernel_min_d=2048)) == "kernel"
  assert choice(8, 16, 4096, config=sonic_jax.Config(gather_sum_kernel=False)) == "xla"
  assert len(calls) == 3
  # Without Pallas's Triton lowering nothing folds the extras: XLA's sum adds them.
  monkeypatch.setattr(mosaic_backend.extras_sum, "AVAILABLE", False)
  assert choice(8, 16, 4096, extras=True) == "xla"


@pytest.mark.parametrize("compiled", MODES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("weighted", [True, False])
def test_fold_extras_matches_the_segment_sum(rng, compiled, dtype, weighted):
  """`sonic_jax.pallas.extras_sum.fold_extras` against its segment-sum reference: tokens with one
  and with several extra pairs (listed in any order), with and without a slot-0 row (routed
  nowhere: R, or past it), unused entries (tokens -1 and T, a row past the buffer) and padding
  rows that are NaN and must not be read; every other row unchanged; and the gather over the
  folded slot 0 equals slot 0 plus the segment sum."""
  from sonic_jax.pallas import extras_sum
  if compiled != (jax.default_backend() == "gpu"):
    pytest.skip("compiled on a GPU, interpreted elsewhere")
  t, d, r, x = (37, 384, 100, 40) if not compiled else (3000, 4096, 9000, 4000)
  rows = rng.standard_normal((r, d)).astype(np.float32)
  rows[-3:] = np.nan
  token = rng.integers(0, t, x)
  token[: x // 8] = 3  # one token with many extras
  placed = rng.permutation(r - 3)  # every pair its own row
  row, slot_row = placed[:x], placed[x:x + t].copy()
  slot_row[rng.random(t) < 0.3] = r  # slot 0 routed nowhere
  slot_row[3], slot_row[4] = r + 5, r  # (also for the token with many extras)
  unused = rng.random(x) < 0.3
  token[unused] = np.where(rng.random(unused.sum()) < 0.5, -1, t)
  row[unused] = r - 1
  token[-1], row[-1] = 5, r + 7  # a row past the buffer: unused
  rows = jnp.asarray(rows, dtype)
  token, row = jnp.asarray(token, jnp.int32), jnp.asarray(row, jnp.int32)
  slot_row = jnp.asarray(slot_row, jnp.int32)
  w = jnp.asarray(rng.uniform(0.1, 1.0, x), jnp.float32) if weighted else None
  w0 = jnp.asarray(rng.uniform(0.1, 1.0, t), jnp.float32) if weighted else None
  fold = jax.jit(functools.partial(extras_sum.fold_extras, interpret=not compiled))
  got, got_row, got_w0 = fold(rows, slot_row, w0, token, row, w)
  want, _, _ = extras_sum.reference(rows, slot_row, w0, token, row, w)
  assert (got_w0 is None) == (not weighted)
  with_extras = sorted({int(a) for a, b in zip(np.asarray(token), np.asarray(row))
                        if 0 <= a < t and b < r})
  folded = np.asarray(got_row)[with_extras]
  assert np.all(folded < r) and len(set(folded)) == len(folded) > 1
  assert np.any(np.asarray(slot_row)[with_extras] >= r)  # folded into an extra row too
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert rel_err(got64[folded], want64[folded]) < tol
  rest = np.setdiff1d(np.arange(r), folded)
  np.testing.assert_array_equal(np.asarray(got, np.float32)[rest],
                                np.asarray(rows, np.float32)[rest])
  # Slot 0 now gives the token's slot pair and extras, weighted; other tokens keep theirs.
  rows64 = np.asarray(rows, np.float64)
  expect = np.zeros((t, d))
  for a, b, c in zip(np.asarray(token), np.asarray(row), range(x)):
    if 0 <= a < t and b < r:
      expect[a] += (1.0 if w is None else float(w[c])) * rows64[b]
  for a in range(t):
    if 0 <= slot_row[a] < r:
      expect[a] += (1.0 if w0 is None else float(w0[a])) * rows64[slot_row[a]]
  new_w0 = np.ones(t) if got_w0 is None else np.asarray(got_w0, np.float64)
  new_row = np.asarray(got_row)
  ok = new_row < r
  summed = np.where(ok[:, None], new_w0[:, None] * got64[np.minimum(new_row, r - 1)], 0.0)
  assert rel_err(summed, expect) < tol


def test_extras_kernel_refusals_and_lowering():
  from sonic_jax.pallas import extras_sum
  assert "d=100" in extras_sum.supports(jnp.zeros((4, 100)))
  if jax.default_backend() != "gpu":  # the Triton kernel lowers for a GPU from this machine
    shapes = [((150000, 4096), jnp.bfloat16), ((16384,), jnp.int32), ((16384,), jnp.float32),
              ((16384,), jnp.int32), ((16384,), jnp.int32), ((16384,), jnp.float32)]
    module = export_for_h100(
        extras_sum.fold_extras,
        *(jax.ShapeDtypeStruct(s, dt) for s, dt in shapes))
    assert "xla.gpu.triton" in module
