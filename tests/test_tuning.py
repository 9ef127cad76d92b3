"""The tuned-configuration table: lookup, validation, and that the backend hands its choice to the
kernels."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

import sonic_jax
from sonic_jax import activations as acts
from sonic_jax.layout import build_grouped_layout
from sonic_jax.mosaic_gpu import backend as mosaic_backend
from sonic_jax.mosaic_gpu import tuning
from sonic_jax.mosaic_gpu.grouped_gemm import GroupedGemmConfig

H100 = "NVIDIA H100 80GB HBM3"


def _entry(role, d, n, e, device=H100, **config):
  return {"role": role, "device": device, "d": d, "n": n, "E": e, "config": config}


def _table(*entries):
  return tuning.TuningTable.from_entries(entries)


def test_nearest_entry_of_the_role_wins():
  table = _table(_entry("up", 768, 512, 128, grid_tile_width=1),
                 _entry("up", 4096, 2048, 64, grid_tile_width=8, num_stages=3),
                 _entry("down", 768, 256, 128, num_stages=3))
  fields = lambda role, d, n, e: table.fields(role, d=d, n=n, num_experts=e, device_kind=H100)
  assert fields("up", 1024, 512, 128) == {"grid_tile_width": 1}
  assert fields("up", 4096, 1024, 64) == {"grid_tile_width": 8, "num_stages": 3}
  assert fields("dx", 768, 512, 128) == {}  # no entries: defaults


def test_entries_of_the_same_gpu_come_first():
  table = _table(_entry("down", 768, 256, 128, num_stages=3),
                 _entry("down", 4096, 2048, 64, device="NVIDIA H200", grid_tile_width=2))
  fields = lambda device: table.fields("down", d=768, n=256, num_experts=128, device_kind=device)
  assert fields("NVIDIA H200") == {"grid_tile_width": 2}
  assert fields("NVIDIA H800") == {"num_stages": 3}  # none of its own: any GPU's


def test_bad_tables_are_refused():
  with pytest.raises(ValueError, match="role must be one of"):
    _table(_entry("gate", 768, 256, 8))
  with pytest.raises(ValueError, match="not tunable"):
    _table(_entry("weight_grad", 768, 256, 8, grid_tile_width=2))
  with pytest.raises(ValueError, match="not tunable"):  # the core's field, not the varlen-K one's
    _table(_entry("weight_grad", 768, 256, 8, cluster_m=2))
  for role in ("up", "dh"):  # the roles that gather their rows run unclustered
    with pytest.raises(ValueError, match="not tunable"):
      _table(_entry(role, 768, 256, 8, cluster_m=2))
  with pytest.raises(ValueError, match="not tunable"):  # dH's own field, on another role
    _table(_entry("dx", 768, 256, 8, wide_h_loads="registers"))
  with pytest.raises(ValueError, match="not tunable"):  # dH's column block follows its schedule
    _table(_entry("dh", 768, 256, 8, block_n=128))
  with pytest.raises(ValueError, match="lacks"):
    _table({"role": "up", "config": {}})
  with pytest.raises(ValueError, match="role must be one of"):
    _table().fields("gate", d=1, n=1, num_experts=1)
  with pytest.raises(TypeError, match="TuningTable"):
    sonic_jax.Config(tuning=[_entry("up", 768, 256, 8)])
  # Values too, when the table loads: every role's kernels build every role's configuration
  for entry, match in ((_entry("up", 768, 512, 8, schedule="pingpong"), "not tunable"),
                       (_entry("weight_grad", 768, 256, 8, num_stages=0), "num_stages"),
                       (_entry("down", 768, 256, 8, grid_tile_width=0), "grid_tile_width"),
                       (_entry("dh", 768, 256, 8, memory_registers=256), "memory_registers"),
                       (_entry("dh", 768, 256, 8, wide_h_loads="sometimes"), "wide_h_loads")):
    with pytest.raises(ValueError, match=f"entry 0.*{match}"):
      _table(entry)


def test_merged_table_keeps_what_a_run_did_not_measure():
  base = _table(_entry("up", 768, 512, 128, grid_tile_width=1), _entry("down", 768, 256, 128),
                _entry("up", 768, 512, 128, device="NVIDIA H200", num_stages=3))
  new = _table(_entry("up", 768, 512, 128, grid_tile_width=8), _entry("dx", 4096, 512, 256))
  got = base.merged(new)
  assert got.entries == base.entries[1:] + new.entries  # the H100 "up" entry replaced


def test_tables_load_from_files_and_are_hashable(tmp_path):
  path = tmp_path / "table.json"
  path.write_text(json.dumps({"entries": [_entry("up", 768, 512, 128, grid_tile_width=2)]}))
  a, b = tuning.TuningTable.load(str(path)), tuning.TuningTable.load(str(path))
  assert a == b and hash(sonic_jax.Config(tuning=a)) == hash(sonic_jax.Config(tuning=b))
  assert a.entries == (tuning.Entry("up", H100, 768, 512, 128, (("grid_tile_width", 2),)),)
  for entry in tuning.packaged().entries:
    assert entry.role in tuning.ROLES


def test_backend_passes_the_tuned_config_to_the_kernels(monkeypatch):
  monkeypatch.setattr(tuning, "target_device", lambda: type("D", (), {"device_kind": H100}))
  table = _table(_entry("up", 256, 256, 4, grid_tile_width=2, num_stages=3),
                 _entry("dx", 256, 256, 4, grid_tile_width=1, cluster_m=2),
                 _entry("weight_grad", 256, 128, 4, num_stages=3, cluster=2),
                 _entry("dh", 256, 128, 4, num_stages=3, wide_h_loads="registers"),
                 _entry("down", 256, 128, 4, num_stages=6))
  config = sonic_jax.Config(tuning=table)
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
  mosaic_backend.up_projection(x, w1, None, layout, acts.get_activation("swiglu"), "concat",
                               config=config)
  mosaic_backend.dx_projection(jnp.zeros((layout.num_rows, 256), jnp.bfloat16), w1, layout,
                               config=config)
  mosaic_backend.weight_grads(x, x, None, jnp.zeros((layout.num_rows, 256), jnp.bfloat16),
                              jnp.zeros((layout.num_rows, 128), jnp.bfloat16),
                              jnp.zeros((layout.num_rows,)), layout, False, False, config=config)
  assert seen["up"].gemm == GroupedGemmConfig(grid_tile_width=2, num_stages=3)
  assert seen["dx"].gemm == GroupedGemmConfig(grid_tile_width=1, cluster_m=2)
  assert seen["weight_grad"].num_stages == 3 and seen["weight_grad"].cluster == 2
  configs = mosaic_backend.role_configs(256, 128, 4, glu=True, config=config)
  assert configs.dh.gemm == GroupedGemmConfig(num_stages=3)
  assert (configs.dh.block_n, configs.dh.wide_h_loads) == (128, "registers")
  assert configs.down.gemm == GroupedGemmConfig(num_stages=6)
  # Without a table of its own the call takes the packaged one.
  assert mosaic_backend.role_configs(256, 128, 4, glu=True).up.gemm == GroupedGemmConfig()


def test_a_pingpong_dh_entry_is_for_the_concat_layout(monkeypatch):
  """The table's pingpong dH configuration runs with the concat layout; the interleaved layout
  (its H pairs read from SMEM, which only the cooperative tile has room for) runs the defaults."""
  from sonic_jax.mosaic_gpu import dh_projection as dh
  monkeypatch.setattr(tuning, "target_device", lambda: type("D", (), {"device_kind": H100}))
  config = sonic_jax.Config(tuning=_table(
      _entry("dh", 256, 256, 4, schedule="pingpong", num_stages=6)))
  concat = mosaic_backend.role_configs(256, 256, 4, True, "concat", config).dh
  interleaved = mosaic_backend.role_configs(256, 256, 4, True, "interleaved", config).dh
  assert concat.gemm == GroupedGemmConfig(schedule="pingpong", num_stages=6)
  assert concat.block_n == 128  # the narrow block: a pingpong warpgroup holds a whole tile
  assert interleaved == dh.DhProjectionConfig(block_n=256)
