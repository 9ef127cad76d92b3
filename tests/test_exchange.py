"""The all-to-all exchange plan (sonic_jax.exchange) against a plain-NumPy model of the exchange.

The model: every sender lists its pairs sorted by expert; its slot for receiver j holds the first S
of those routed to j's experts; receiver j's buffer is the senders' slots in device order. Labelled
rows go through an all-to-all of whole slots (in NumPy): the receive buffers must be the model's,
and the plan must name each received row's local expert and count the dropped pairs.
`slot_layout` must put every pair in the model's slot row.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from sonic_jax.exchange import exchange_plan, slot_layout
from sonic_jax.layout import build_grouped_layout
from sonic_jax.parallel import slot_capacity


def model_slots(counts, slot_rows):
  """[i][j]: the (sender, rank among i's sorted pairs, global expert) rows of i's slot for j."""
  p, e_count = counts.shape
  e_local = e_count // p
  slots = []
  for i in range(p):
    rank, per_receiver = 0, []
    for j in range(p):
      rows = []
      for e in range(j * e_local, (j + 1) * e_local):
        for _ in range(counts[i, e]):
          rows.append((i, rank, e))
          rank += 1
      per_receiver.append(rows[:slot_rows])
    slots.append(per_receiver)
  return slots


def run_dense(operands, slot_rows):
  p = len(operands)
  return [np.concatenate([operands[i][j * slot_rows:(j + 1) * slot_rows] for i in range(p)])
          for j in range(p)]


@pytest.mark.parametrize("p,e_local,capacity_kind", [
    (1, 4, "worst"), (2, 3, "worst"), (3, 2, "tight"), (4, 2, "worst"), (4, 2, "tight"),
    (8, 1, "tight"), (8, 2, "zero_heavy")])
def test_exchange_plan_matches_numpy_model(p, e_local, capacity_kind):
  rng = np.random.default_rng(p * 10 + e_local)
  e_count = p * e_local
  for trial in range(4):
    counts = rng.integers(0, 6, size=(p, e_count))
    if capacity_kind == "zero_heavy":  # empty experts and one hot device
      counts[:, rng.random(e_count) < 0.5] = 0
      counts[:, :e_local] += 9
    worst = int(max(counts.reshape(p, p, e_local).sum(2).max(), 1))
    slot_rows = worst if capacity_kind == "worst" else max(1, worst * (trial + 1) // 5)
    plans = [exchange_plan(jnp.asarray(counts, jnp.int32), jnp.int32(me), slot_rows)
             for me in range(p)]
    model = model_slots(counts, slot_rows)

    # Send buffers of labelled rows as the model fills them; -1 marks padding.
    sends = []
    for i in range(p):
      buf = np.full((p * slot_rows, 3), -1, np.int64)
      for j in range(p):
        rows = np.asarray(model[i][j], np.int64).reshape(-1, 3)
        buf[j * slot_rows:j * slot_rows + len(rows)] = rows
      sends.append(buf)
    dense = run_dense(sends, slot_rows)
    dropped = int(counts.sum()) - sum(len(model[i][j]) for i in range(p) for j in range(p))
    for j in range(p):
      row_expert = np.asarray(plans[j].row_expert)
      for i in range(p):
        got = dense[j][i * slot_rows:(i + 1) * slot_rows]
        want = np.asarray(model[i][j], np.int64).reshape(-1, 3)
        np.testing.assert_array_equal(got[:len(want)], want)
        assert np.all(got[len(want):] == -1)
        experts = row_expert[i * slot_rows:(i + 1) * slot_rows]
        np.testing.assert_array_equal(experts[:len(want)], want[:, 2] - j * e_local)
        assert np.all(experts[len(want):] == e_local)
    for plan in plans:
      assert int(plan.dropped) == dropped
    assert (dropped == 0) == (capacity_kind == "worst" or slot_rows >= worst)


@pytest.mark.parametrize("p,capacity_factor", [(2, None), (4, None), (4, 0.5)])
def test_slot_layout_places_pairs_as_the_model(p, capacity_factor):
  rng = np.random.default_rng(p)
  t_count, k, e_local = 24, 2, 2
  e_count = p * e_local
  ids = np.stack([rng.choice(e_count, k, replace=False) for _ in range(t_count)])
  ids[rng.random(ids.shape) < 0.1] = -1  # some pairs routed nowhere
  slot_rows = slot_capacity(t_count, k, 0, p, e_local, capacity_factor)
  pairs = build_grouped_layout(jnp.asarray(ids, jnp.int32), e_count, 1)
  send = slot_layout(pairs, p, slot_rows)
  want_row = np.full(ids.shape, p * slot_rows)
  for j in range(p):
    flat = [(t * k + s, ids[t, s]) for t in range(t_count) for s in range(k)
            if j * e_local <= ids[t, s] < (j + 1) * e_local]
    flat.sort(key=lambda q: (q[1], q[0]))  # expert order, stable in pair order
    for rank, (pair, _) in enumerate(flat[:slot_rows]):
      want_row[pair // k, pair % k] = j * slot_rows + rank
  np.testing.assert_array_equal(np.asarray(send.pair_row), want_row)
  row_token = np.asarray(send.row_token)
  used = want_row < p * slot_rows
  np.testing.assert_array_equal(row_token[want_row[used]], np.nonzero(used)[0])
  assert int(np.sum(np.asarray(send.row_pair) >= 0)) == used.sum()


def test_slot_capacity():
  assert slot_capacity(64, 2, 0, 4, 2, None) == 64 * 2
  assert slot_capacity(64, 8, 0, 4, 2, None) == 64 * 2  # a token reaches <= E_local experts here
  assert slot_capacity(64, 2, 10, 4, 2, None) == 64 * 2 + 10
  # a given selection may name one expert more than once: K pairs a token can reach a device
  assert slot_capacity(64, 8, 10, 4, 2, None, distinct_experts=False) == 64 * 8 + 10
  assert slot_capacity(64, 2, 0, 4, 2, 1.25) == 40
  assert slot_capacity(64, 2, 0, 4, 2, 100.0) == 64 * 2  # never above the worst case
  with pytest.raises(ValueError, match="capacity_factor"):
    slot_capacity(64, 2, 0, 4, 2, 0.0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(capacity_factor=-1.0), "capacity_factor"),
    (dict(router_e=6), "router_weight"), (dict(w1_d=8), "w1")])
def test_moe_all_to_all_bad_arguments(kwargs, match):
  import jax
  from jax.sharding import PartitionSpec as P
  from sonic_jax.parallel import moe_all_to_all
  router_e, w1_d = kwargs.pop("router_e", 4), kwargs.pop("w1_d", 16)
  x = jnp.ones((8, 16))
  rw, w1, w2 = jnp.ones((16, router_e)), jnp.ones((4, w1_d, 16)), jnp.ones((4, 8, 16))
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
  layer = jax.shard_map(
      lambda x, rw, w1, w2: moe_all_to_all(x, rw, w1, w2, axis_name="ep", top_k=2,
                                           backend="xla", **kwargs)[0],
      mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)  # one device: all local
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(layer, x, rw, w1, w2)
