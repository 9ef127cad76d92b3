"""The layout's block-rank kernel against its NumPy reference, and the counting-sort layout it
feeds against the sorted one: interpreted on CPU, compiled on a GPU (-m gpu)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import export_for_h100
from sonic_jax.layout import build_grouped_layout
from sonic_jax.pallas import layout_ranks

ON_GPU = jax.default_backend() == "gpu"
MODES = [pytest.param(False, id="interpret"), pytest.param(True, id="compiled", marks=pytest.mark.gpu)]
# (T, S, E): several token blocks with a ragged last one, S and E not powers of two, one expert,
# E at the kernel's limit, more token blocks (69) than the layout's block prefix sums in one level.
SHAPES = [(300, 8, 64), (100, 6, 200), (70, 16, 256), (129, 1, 1), (40, 4, 1024), (1, 2, 3),
          (1100, 2, 512)]
# The layouts' (T, S, E, row tile): compiled, every shape with both tiles; interpreted, each shape
# with the one given, both among the shapes (the tile enters only each expert's first row,
# `layout._rows_by_block_ranks`, which the kernel's ranks are added to). Likewise with extras.
def _with_tiles(shapes_and_tiles, tiles):
  return [(*shape, tile) for shape, interpreted in shapes_and_tiles for tile in tiles
          if ON_GPU or tile == interpreted]


LAYOUT_CASES = _with_tiles(zip(SHAPES, (128, 1, 1, 128, 128, 1, 128)), (1, 128))
EXTRAS_CASES = _with_tiles((((300, 2, 8, 16), 1), ((129, 1, 1, 4), 1), ((70, 4, 100, 3), 32),
                            ((5, 2, 3, 1), 32)), (1, 32))


def _ids(rng, t, s, e, kind):
  """Routings as top-K gives them (distinct per token) or stranger: skewed, with pairs routed
  nowhere (-1 and ids >= E), with a token repeating an expert."""
  if kind == "topk":
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :s] if s <= e else rng.integers(0, e, (t, s))
  else:
    ids = rng.integers(0, e, (t, s))
  if kind == "skewed":
    ids[: t // 2 + 1, 0] = e - 1
    ids[ids == e // 2] = 0  # expert e/2 gets nothing (E > 1)
  if kind == "unrouted":
    ids[rng.random((t, s)) < 0.3] = -1
    ids[rng.random((t, s)) < 0.1] = e + 3
  if kind == "repeats" and s > 1:
    ids[::3, 1] = ids[::3, 0]
  return jnp.asarray(ids, jnp.int32)


@pytest.mark.parametrize("compiled", MODES)
@pytest.mark.parametrize("kind", ["topk", "skewed", "unrouted", "repeats"])
@pytest.mark.parametrize("t,s,e", SHAPES)
def test_block_ranks_match_reference(rng, compiled, t, s, e, kind):
  if compiled != ON_GPU:
    pytest.skip("compiled on a GPU, interpreted elsewhere")
  if compiled:
    t = t * 37
  ids = _ids(rng, t, s, e, kind)
  ranks, counts = layout_ranks.block_ranks(ids, e, interpret=not compiled)
  want_ranks, want_counts = layout_ranks.block_ranks_reference(ids, e, layout_ranks.block_tokens(e))
  assert ranks.shape == (t, s) and counts.shape == want_counts.shape
  valid = (np.asarray(ids) >= 0) & (np.asarray(ids) < e)
  np.testing.assert_array_equal(np.where(valid, np.asarray(ranks), 0), want_ranks)
  np.testing.assert_array_equal(np.asarray(counts), want_counts)


@pytest.mark.parametrize("compiled", MODES)
@pytest.mark.parametrize("kind", ["topk", "skewed", "unrouted", "repeats"])
@pytest.mark.parametrize("t,s,e,row_tile", LAYOUT_CASES)
def test_counting_sort_layout_equals_sorted_layout(rng, compiled, t, s, e, row_tile, kind):
  """Every field of the layout, padding rows included, equals the stable sort's."""
  if compiled != ON_GPU:
    pytest.skip("compiled on a GPU, interpreted elsewhere")
  if compiled:
    t = t * 37
  ids = _ids(rng, t, s, e, kind)
  build = jax.jit(build_grouped_layout, static_argnums=(1, 2), static_argnames="method")
  got = build(ids, e, row_tile, method="block_ranks")
  want = build(ids, e, row_tile, method="sort")
  for name, a, b in zip(got._fields, got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  if ON_GPU:  # "auto" picks the kernel on a GPU
    auto = build(ids, e, row_tile)
    for name, a, b in zip(got._fields, auto, want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("compiled", MODES)
@pytest.mark.parametrize("t,s,e,j,row_tile", EXTRAS_CASES)
def test_counting_sort_places_extras_grouped_by_expert(rng, compiled, t, s, e, j, row_tile):
  """Extra pairs grouped by expert (token rounding's lists, with unused entries anywhere and an
  entry naming another expert, which the grouping makes unused): the counting sort places them
  as the stable sort does."""
  if compiled != ON_GPU:
    pytest.skip("compiled on a GPU, interpreted elsewhere")
  if compiled:
    t = t * 37
  ids = _ids(rng, t, s, e, "unrouted")
  tokens = rng.integers(0, t, (e, j))
  experts = np.broadcast_to(np.arange(e)[:, None], (e, j)).copy()
  experts[rng.random((e, j)) < 0.3] = e  # unused
  experts[0, 0] = min(1, e - 1) if e > 1 else e  # another expert's entry in expert 0's group
  tokens, experts = (jnp.asarray(a.reshape(-1), jnp.int32) for a in (tokens, experts))
  build = jax.jit(build_grouped_layout, static_argnums=(1, 2),
                  static_argnames=("method", "extras_by_expert"))
  got = build(ids, e, row_tile, tokens, experts, extras_by_expert=True, method="block_ranks")
  want = build(ids, e, row_tile, tokens, experts, extras_by_expert=True, method="sort")
  for name, a, b in zip(got._fields, got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  # Padding rows read the token of their expert's first row (an extra pair's where it has no
  # slot pairs), rows past the used tiles token 0.
  row_token, row_pair = np.asarray(got.row_token), np.asarray(got.row_pair)
  sizes = np.asarray(got.group_sizes)
  for first, size in zip(np.cumsum(sizes) - sizes, sizes):
    pad = np.arange(first, first + size)[row_pair[first:first + size] < 0]
    assert np.all(row_token[pad] == row_token[first])
  assert np.all(row_token[sizes.sum():] == 0)
  # The entry naming another expert is unused; the others are where the plain sort puts them.
  if e > 1:
    assert int(got.extra_token[0]) == t
    plain = build(ids, e, row_tile, tokens, experts.at[0].set(e), method="sort")
    for name, a, b in zip(got._fields, got, plain):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("blocks", [1, 31, 32, 33, 64, 100, 1281])
def test_two_level_block_prefix_is_the_exclusive_cumsum(rng, blocks):
  from sonic_jax.layout import _exclusive_cumsum_rows
  x = rng.integers(0, 300, (blocks, 5)).astype(np.int32)
  got = jax.jit(_exclusive_cumsum_rows)(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(got), np.cumsum(x, axis=0) - x)


@pytest.mark.parametrize("e,limit", [(8, 128), (128, 128), (129, 128), (256, 128), (256, 256),
                                     (8, 0)])
def test_auto_takes_the_kernel_on_a_gpu_up_to_its_expert_limit(e, limit):
  import sonic_jax
  config = sonic_jax.Config(layout_kernel_max_experts=limit)
  jaxpr = str(jax.make_jaxpr(lambda i: build_grouped_layout(i, e, 128, config=config))(
      jnp.zeros((64, 4), jnp.int32)))
  assert ("pallas_call" in jaxpr) == (ON_GPU and e <= limit)


def test_unsupported_routings_are_named():
  ids = jnp.zeros((8, 4), jnp.int32)
  assert "E=2000" in layout_ranks.supports(ids, 2000)
  assert "S=40" in layout_ranks.supports(jnp.zeros((8, 40), jnp.int32), 8)
  assert "int32" in layout_ranks.supports(ids.astype(jnp.int16), 8)
  assert "(T, S)" in layout_ranks.supports(ids.reshape(-1), 8)
  with pytest.raises(ValueError, match="E=2000"):
    layout_ranks.block_ranks(ids, 2000, interpret=True)
  with pytest.raises(ValueError, match="extra pairs"):
    build_grouped_layout(ids, 8, 4, jnp.zeros((3,), jnp.int32), jnp.zeros((3,), jnp.int32),
                         method="block_ranks")
  with pytest.raises(ValueError, match="E \\* J extra pairs"):
    build_grouped_layout(ids, 8, 4, jnp.zeros((3,), jnp.int32), jnp.zeros((3,), jnp.int32),
                         extras_by_expert=True)
  with pytest.raises(ValueError, match="E=2000"):
    build_grouped_layout(ids, 2000, 4, method="block_ranks")
  with pytest.raises(ValueError, match="method must be one of"):
    build_grouped_layout(ids, 8, 4, method="radix")
  # "auto" falls back to the sort where the kernel does not apply.
  lay = build_grouped_layout(ids, 2000, 4)
  np.testing.assert_array_equal(np.asarray(lay.expert_counts[:1]), [32])


def test_kernel_lowers_for_cuda():
  """The Triton kernel lowers for a GPU from this machine (`jax.export` for 'cuda')."""
  if ON_GPU:
    pytest.skip("CPU-side check")
  module = export_for_h100(lambda i: layout_ranks.block_ranks(i, 128),
                           jax.ShapeDtypeStruct((1000, 8), jnp.int32))
  assert "xla.gpu.triton" in module
