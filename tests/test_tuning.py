"""The tuned-configuration table: lookup, validation, and that the backend hands its choice to the
kernels."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from sonic_jax import activations as acts
from sonic_jax.layout import build_grouped_layout
from sonic_jax.mosaic_gpu import backend as mosaic_backend
from sonic_jax.mosaic_gpu import tuning
from sonic_jax.mosaic_gpu.grouped_gemm import GroupedGemmConfig

H100 = "NVIDIA H100 80GB HBM3"


def _entry(role, d, n, e, device=H100, **config):
  return {"role": role, "device": device, "d": d, "n": n, "E": e, "config": config}


@pytest.fixture
def table():
  yield tuning.set_table
  tuning.set_table(None)


def test_nearest_entry_of_the_role_wins(table, monkeypatch):
  monkeypatch.setattr(tuning, "_device_kind", lambda: H100)
  table([_entry("up", 768, 512, 128, grid_tile_width=1),
         _entry("up", 4096, 2048, 64, grid_tile_width=8, num_stages=3),
         _entry("down", 768, 256, 128, num_stages=3)])
  assert tuning.tuned_fields("up", d=1024, n=512, num_experts=128) == {"grid_tile_width": 1}
  assert tuning.tuned_fields("up", d=4096, n=1024, num_experts=64) == {"grid_tile_width": 8,
                                                                       "num_stages": 3}
  assert tuning.tuned_fields("dx", d=768, n=512, num_experts=128) == {}  # no entries: defaults
  config = tuning.gemm_config("up", d=4096, n=4096, num_experts=32)
  assert config == GroupedGemmConfig(grid_tile_width=8, num_stages=3)


def test_entries_of_the_same_gpu_come_first(table, monkeypatch):
  monkeypatch.setattr(tuning, "_device_kind", lambda: "NVIDIA H200")
  table([_entry("down", 768, 256, 128, num_stages=3),
         _entry("down", 4096, 2048, 64, device="NVIDIA H200", grid_tile_width=2)])
  assert tuning.tuned_fields("down", d=768, n=256, num_experts=128) == {"grid_tile_width": 2}
  monkeypatch.setattr(tuning, "_device_kind", lambda: "NVIDIA H800")  # none of its own: any GPU's
  assert tuning.tuned_fields("down", d=768, n=256, num_experts=128) == {"num_stages": 3}


def test_bad_tables_are_refused():
  with pytest.raises(ValueError, match="role must be one of"):
    tuning.validate([_entry("gate", 768, 256, 8)])
  with pytest.raises(ValueError, match="not tunable"):
    tuning.validate([_entry("weight_grad", 768, 256, 8, grid_tile_width=2)])
  with pytest.raises(ValueError, match="not tunable"):  # the core's field, not the varlen-K one's
    tuning.validate([_entry("weight_grad", 768, 256, 8, cluster_m=2)])
  with pytest.raises(ValueError, match="not tunable"):  # dH's own field, on another role
    tuning.validate([_entry("dx", 768, 256, 8, wide_h_loads="registers")])
  with pytest.raises(ValueError, match="lacks"):
    tuning.validate([{"role": "up", "config": {}}])
  with pytest.raises(ValueError, match="role must be one of"):
    tuning.tuned_fields("gate", d=1, n=1, num_experts=1)


def test_merged_table_keeps_what_a_run_did_not_measure():
  base = [_entry("up", 768, 512, 128, grid_tile_width=1), _entry("down", 768, 256, 128),
          _entry("up", 768, 512, 128, device="NVIDIA H200", num_stages=3)]
  new = [_entry("up", 768, 512, 128, grid_tile_width=8), _entry("dx", 4096, 512, 256)]
  got = tuning.merged(base, new)
  assert got == base[1:] + new  # the H100 "up" entry replaced, the H200 one kept
  assert tuning.validate(got) == got


def test_packaged_table_loads():
  tuning.set_table(None)
  for entry in tuning.table():
    assert entry["role"] in tuning.ROLES


def test_backend_passes_the_tuned_config_to_the_kernels(table, monkeypatch):
  monkeypatch.setattr(tuning, "_device_kind", lambda: H100)
  table([_entry("up", 256, 256, 4, grid_tile_width=2, num_stages=3),
         _entry("dx", 256, 256, 4, grid_tile_width=1, cluster_m=2),
         _entry("weight_grad", 256, 128, 4, num_stages=3, cluster=2),
         _entry("dh", 256, 256, 4, num_stages=3, wide_h_loads="registers"),
         _entry("down", 256, 128, 4, num_stages=6, block_n=128)])
  seen = {}
  monkeypatch.setattr(mosaic_backend.up, "up_projection",
                      lambda *a, config, **k: seen.setdefault("up", config))
  monkeypatch.setattr(mosaic_backend.dx, "dx_projection",
                      lambda *a, config: seen.setdefault("dx", config))
  monkeypatch.setattr(mosaic_backend.wgrad, "weight_grad",
                      lambda *a, **k: seen.setdefault("weight_grad", a[3]))
  layout = build_grouped_layout(jnp.zeros((16, 2), jnp.int32), 4, 128)
  x = jnp.zeros((16, 256), jnp.bfloat16)
  w1 = jnp.zeros((4, 256, 256), jnp.bfloat16)
  mosaic_backend.up_projection(x, w1, None, layout, acts.get_activation("swiglu"), "concat")
  mosaic_backend.dx_projection(jnp.zeros((layout.num_rows, 256), jnp.bfloat16), w1, layout)
  mosaic_backend.weight_grads(x, x, None, jnp.zeros((layout.num_rows, 256), jnp.bfloat16),
                              jnp.zeros((layout.num_rows, 128), jnp.bfloat16),
                              jnp.zeros((layout.num_rows,)), layout, False, False)
  assert seen["up"].gemm == GroupedGemmConfig(grid_tile_width=2, num_stages=3)
  assert seen["dx"].gemm == GroupedGemmConfig(grid_tile_width=1, cluster_m=2)
  assert seen["weight_grad"].num_stages == 3 and seen["weight_grad"].cluster == 2
  dh_config = mosaic_backend.dh_config(d=256, n=256, num_experts=4)
  assert dh_config.gemm == GroupedGemmConfig(num_stages=3)
  assert (dh_config.block_n, dh_config.wide_h_loads) == (256, "registers")
  down_config = mosaic_backend.down_config(d=256, n=128, num_experts=4)
  assert down_config.gemm == GroupedGemmConfig(num_stages=6) and down_config.block_n == 128


def test_a_pingpong_dh_entry_is_for_the_concat_layout(table, monkeypatch):
  """The table's pingpong dH configuration runs with the concat layout; the interleaved layout
  (its H pairs read from SMEM, which only the cooperative tile has room for) runs the defaults."""
  from sonic_jax.mosaic_gpu import dh_projection as dh
  monkeypatch.setattr(tuning, "_device_kind", lambda: H100)
  table([_entry("dh", 256, 256, 4, schedule="pingpong", num_stages=6, block_n=128)])
  concat = mosaic_backend.dh_config(d=256, n=256, num_experts=4)
  interleaved = mosaic_backend.dh_config(d=256, n=256, num_experts=4,
                                         gate_up_layout="interleaved")
  assert concat.gemm == GroupedGemmConfig(schedule="pingpong", num_stages=6)
  assert concat.block_n == 128
  assert interleaved == dh.DhProjectionConfig(block_n=256)
