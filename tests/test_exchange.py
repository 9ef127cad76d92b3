"""The all-to-all exchange plan (sonic_jax.exchange) against a plain-NumPy model of the exchange.

The model: every sender lists its pairs sorted by expert; receiver j's buffer takes the rows for its
experts from sender 0, then sender 1, ..., and keeps the first `capacity` of them. The plan's
offsets and sizes are run through `jax.lax.ragged_all_to_all`'s documented semantics (its
pseudocode, in NumPy) on labelled rows; the receive buffers must be the model's, the received rows'
local experts the model's, and the combine plan must bring every surviving row back to where it
came from.
"""

import numpy as np
import pytest

from sonic_jax.exchange import exchange_plan
from sonic_jax.parallel import receive_capacity


def model_exchange(counts, capacity):
  """Per receiver j: the list of (sender, position in sender's sorted buffer, global expert)."""
  p, e_count = counts.shape
  e_local = e_count // p
  buffers = []
  for j in range(p):
    rows = []
    for i in range(p):
      position = int(counts[i, :j * e_local].sum())  # rows for devices < j come first
      for e in range(j * e_local, (j + 1) * e_local):
        for _ in range(counts[i, e]):
          rows.append((i, position, e))
          position += 1
    buffers.append(rows[:capacity])
  return buffers


def run_ragged(operands, out_rows, plans):
  """ragged_all_to_all's documented semantics: sender i's slice j goes to device j at the
  offset that i's output_offsets[j] names."""
  p = len(operands)
  outs = [np.full((out_rows,) + operands[0].shape[1:], -1, operands[0].dtype) for _ in range(p)]
  for i, plan in enumerate(plans):
    for j in range(p):
      n, src, dst = int(plan.send_sizes[j]), int(plan.input_offsets[j]), int(plan.output_offsets[j])
      outs[j][dst:dst + n] = operands[i][src:src + n]
      # The receiver's view of the same chunk agrees.
      assert int(plans[j].recv_sizes[i]) == n and int(plans[j].recv_offsets[i]) == dst
  return outs


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
    total_per_sender = counts.sum(1)
    worst = int(max(counts.reshape(p, p, e_local).sum((0, 2)).max(), 1))
    capacity = worst if capacity_kind == "worst" else max(1, worst * (trial + 1) // 5)
    plans = []
    for me in range(p):
      dispatch, combine = exchange_plan(np.asarray(counts, np.int32), np.int32(me), capacity)
      plans.append((dispatch, combine))
    model = model_exchange(counts, capacity)

    # Dispatch of labelled rows: (sender, position, expert) per row of every sender's buffer.
    operands = []
    for i in range(p):
      experts = np.repeat(np.arange(e_count), counts[i])
      operands.append(np.stack([np.full(total_per_sender[i], i), np.arange(total_per_sender[i]),
                                experts], axis=1).astype(np.int64))
    received = run_ragged(operands, capacity, [d for d, _ in plans])
    dropped = 0
    for j in range(p):
      want = np.asarray(model[j], np.int64).reshape(-1, 3)
      got = received[j]
      np.testing.assert_array_equal(got[:len(want)], want)
      assert np.all(got[len(want):] == -1)  # nothing else written
      row_expert = np.asarray(plans[j][0].row_expert)
      np.testing.assert_array_equal(row_expert[:len(want)], want[:, 2] - j * e_local)
      assert np.all(row_expert[len(want):] == e_local)
      dropped += counts[:, j * e_local:(j + 1) * e_local].sum() - len(want)
    for d, _ in plans:
      assert int(d.dropped) == dropped
    if capacity_kind == "worst":
      assert dropped == 0

    # Combine: each receiver sends its buffer back; rows return to their sender positions.
    returned = run_ragged(received, max(total_per_sender.max(), 1), [c for _, c in plans])
    for i in range(p):
      kept_rows = [r for rows in model for r in rows if r[0] == i]
      for sender, position, expert in kept_rows:
        np.testing.assert_array_equal(returned[i][position], [sender, position, expert])
      lost = set(range(total_per_sender[i])) - {r[1] for r in kept_rows}
      assert all(np.all(returned[i][q] == -1) for q in lost)  # dropped rows get nothing back


def test_receive_capacity():
  assert receive_capacity(64, 2, 0, 4, 2, None) == 4 * 64 * 2
  assert receive_capacity(64, 8, 0, 4, 2, None) == 4 * 64 * 2  # a token reaches <= E_local here
  assert receive_capacity(64, 2, 10, 4, 2, None) == 4 * (64 * 2 + 10)
  assert receive_capacity(64, 2, 0, 4, 2, 1.25) == 160
  assert receive_capacity(64, 2, 0, 4, 2, 100.0) == 4 * 64 * 2  # never above the worst case
  with pytest.raises(ValueError, match="capacity_factor"):
    receive_capacity(64, 2, 0, 4, 2, 0.0)
