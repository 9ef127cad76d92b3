"""Hopper kernels against their xla references: in Mosaic GPU interpret mode on CPU (with race
detection) and compiled on an sm90 GPU (`-m gpu`)."""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sonic_jax
from sonic_jax import activations as acts
from sonic_jax import xla_backend
from sonic_jax.layout import build_grouped_layout
from cases import h100_abstract_mesh, make_problem
from oracle import reference_values_and_grads, rel_err, select_experts

ON_GPU = jax.default_backend() == "gpu"


@contextlib.contextmanager
def kernel_mode(compiled: bool, num_cores: int = 2, detect_races: bool = True):
  """Compiled on the GPU, or interpreted on the CPU with a `num_cores`-SM abstract device (with
  the interpreter's race detector unless detect_races=False)."""
  if compiled:
    if not ON_GPU:
      pytest.skip("needs a GPU")
    yield
    return
  if ON_GPU:
    pytest.skip("interpret-mode tests run on CPU machines")
  from jax.experimental.pallas import mosaic_gpu as plgpu
  with jax.sharding.use_abstract_mesh(h100_abstract_mesh(num_cores)), plgpu.force_gpu_interpret_mode(
      plgpu.InterpretGPUParams(detect_races=detect_races)):
    yield


MODES = [pytest.param(False, id="interpret"), pytest.param(True, id="compiled", marks=pytest.mark.gpu)]

# The tests' layouts as one compiled program each: eagerly, each of the layout's ops is an XLA
# compile of its own for every new shape.
_layout = jax.jit(build_grouped_layout, static_argnums=(1, 2))


def _cases_in_modes(names, cases, compiled_only=()):
  """pytest params (*case, compiled) for `names` (a parametrize string): every case compiled on
  the GPU, all but the indices in `compiled_only` also interpreted (those exercise nothing that
  the interpreted cases and the tests named where the list is written do not). Ids as pytest gives
  them for MODES stacked over the cases, so each case keeps its inputs (the rng is seeded by id)."""
  def case_id(i, case):
    return "-".join(str(v) if v is None or isinstance(v, (str, int, float)) else
                    getattr(v, "__name__", None) if isinstance(v, type) else f"{name}{i}"
                    for name, v in zip(names.split(","), case))
  params = []
  for i, case in enumerate(cases):
    if i not in compiled_only:
      params.append(pytest.param(*case, False, id=f"{case_id(i, case)}-interpret"))
    params.append(pytest.param(*case, True, id=f"{case_id(i, case)}-compiled",
                               marks=pytest.mark.gpu))
  return params


def _problem(rng, T, d, n, E, K, activation, skew=False):
  glu = acts.get_activation(activation).is_glu
  width = 2 * n if glu else n
  x = jnp.asarray(rng.standard_normal((T, d)), jnp.bfloat16)
  w1 = jnp.asarray(rng.standard_normal((E, d, width)) / np.sqrt(d), jnp.bfloat16)
  b1 = jnp.asarray(rng.standard_normal((E, width)) * 0.5, jnp.bfloat16)
  ids = rng.integers(0, E, (T, K))
  if skew:  # most pairs on expert 0, the last expert gets nothing
    ids[: 3 * T // 4, 0] = 0
    ids[ids == E - 1] = 1
  return x, w1, b1, jnp.asarray(ids, jnp.int32)


def _rows_err(got, want, layout):
  valid = np.asarray(layout.row_valid())
  got = np.asarray(got, np.float32)[valid]
  want = np.asarray(want, np.float32)[valid]
  assert np.all(np.isfinite(got))
  return rel_err(got, want)


# gpt-oss's clamped SwiGLU with a limit that unit-scale pre-activations cross (its own, 7, they
# rarely reach): both clamps and their zero gradients are exercised.
CLAMPED = acts.clamped_swiglu(alpha=1.702, limit=1.0)

UP_CASES = [
    # (T, d, n, E, K, activation, bias, skew, gate_up_layout)
    (100, 128, 128, 4, 2, CLAMPED, True, False, "interleaved"),
    (70, 64, 128, 3, 2, "geglu_tanh", False, True, "concat"),
    (100, 128, 128, 4, 2, "swiglu", True, False, "concat"),
    (70, 64, 128, 3, 1, "geglu", False, True, "concat"),
    (50, 128, 256, 4, 2, "gelu", True, False, "concat"),
    (64, 64, 256, 2, 2, "relu_sq", False, True, "concat"),
    (100, 128, 256, 4, 2, "swiglu", True, True, "interleaved"),
    (70, 64, 128, 3, 2, "reglu", False, False, "interleaved"),
]
UP_NAMES = "T,d,n,E,K,activation,bias,skew,gate_up_layout"


# Interpreted, all but swiglu (bias, concat): the layer's token-rounding test runs that up kernel
# against the oracle, and the swiglu epilogue, bias and the GLU concat layout are each in another
# case here.
@pytest.mark.parametrize(f"{UP_NAMES},compiled", _cases_in_modes(UP_NAMES, UP_CASES, [2]))
def test_up_projection_matches_reference(rng, compiled, T, d, n, E, K, activation, bias, skew,
                                         gate_up_layout):
  from sonic_jax.mosaic_gpu import up_projection as up
  if compiled:  # real sizes on the GPU
    T, d, E = T * 40, d * 4, E * 4
  x, w1, b1, ids = _problem(rng, T, d, n, E, K, activation, skew)
  b1 = b1 if bias else None
  act = acts.get_activation(activation)
  layout = _layout(ids, E, 128)
  with kernel_mode(compiled):
    h, a = jax.jit(lambda *args: up.up_projection(*args, layout, act, gate_up_layout))(x, w1, b1)
  h_ref, a_ref = xla_backend.up_projection(x, w1, b1, layout, act, gate_up_layout)
  assert _rows_err(h, h_ref, layout) < 1e-2
  assert _rows_err(a, a_ref, layout) < 1e-2


# Interpreted with a bias only: the layer's gather-sum test runs the kernel without one (d = 256)
# against the oracle.
@pytest.mark.parametrize("bias,compiled", _cases_in_modes("bias", [(False,), (True,)], [0]))
def test_down_projection_matches_reference(rng, compiled, bias):
  from sonic_jax.mosaic_gpu import down_projection as down
  T, n, d, E = (90, 128, 256, 3) if not compiled else (4000, 512, 1024, 16)
  ids = jnp.asarray(rng.integers(0, E, (T, 2)), jnp.int32)
  layout = _layout(ids, E, 128)
  a = jnp.asarray(rng.standard_normal((layout.num_rows, n)), jnp.bfloat16)
  w2 = jnp.asarray(rng.standard_normal((E, n, d)) / np.sqrt(n), jnp.bfloat16)
  b2 = jnp.asarray(rng.standard_normal((E, d)), jnp.bfloat16) if bias else None
  with kernel_mode(compiled):
    y = jax.jit(lambda a, w2, b2: down.down_projection(a, w2, b2, layout))(a, w2, b2)
  assert _rows_err(y, xla_backend.down_projection(a, w2, b2, layout), layout) < 1e-2


@pytest.mark.parametrize("compiled", MODES)
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("activation,skew", [("swiglu", True), ("gelu", False)])
def test_pingpong_schedule_matches_reference(rng, compiled, decoupled, activation, skew):
  """The pingpong schedule (the compute warpgroups take whole tiles in turn) of dH (gathered dO,
  H read into registers by 64-row blocks, dS partials) against the XLA reference, on an odd
  number of tiles per CTA and an expert without rows; compiled, also bit for bit against the
  cooperative schedule. In 2-CTA clusters it is refused."""
  from sonic_jax.mosaic_gpu import dh_projection as dh
  from sonic_jax.mosaic_gpu.grouped_gemm import GroupedGemmConfig
  if not compiled and (decoupled or activation != "swiglu"):
    pytest.skip("interpreted: one case (the interpreter runs the coupled form only, and a "
                "gathered case takes a minute there)")
  T, d, n, E = (150, 128, 256, 3) if not compiled else (6000, 1024, 512, 12)
  # Decoupled when a tile's k-steps use every ring slot an even number of times: 16 / 8 k-steps
  # (compiled) on 4 stages; coupled on 5 (and always in the interpreter).
  stages = 4 if decoupled else 5
  pingpong = GroupedGemmConfig(schedule="pingpong", num_stages=stages)
  with pytest.raises(ValueError, match="pingpong schedule runs unclustered"):
    GroupedGemmConfig(schedule="pingpong", cluster_m=2)
  _, _, _, ids = _problem(rng, T, d, n, E, 2, activation, skew)
  act = acts.get_activation(activation)
  layout = _layout(ids, E, 128)
  h = jnp.asarray(rng.standard_normal((layout.num_rows, act.width_multiplier() * n)), jnp.bfloat16)
  d_out = jnp.asarray(rng.standard_normal((T, d)), jnp.bfloat16)
  w2 = jnp.asarray(rng.standard_normal((E, n, d)) / np.sqrt(d), jnp.bfloat16)
  scores = jnp.where(layout.row_valid(),
                     jnp.asarray(rng.uniform(0.1, 1.0, layout.num_rows), jnp.float32), 0.0)

  def run(gemm):
    d_h, a_s, ds_parts = dh.dh_projection(d_out, h, scores, w2, layout, act,
                                          config=dh.DhProjectionConfig(gemm, block_n=128))
    return d_h, a_s, ds_parts.T  # dS partials as (rows, column blocks)

  d_h, a_s, d_s, _ = xla_backend.dh_projection(d_out, h, scores, w2, None, layout, act, "concat")
  want = (d_h, a_s, None)
  with kernel_mode(compiled):
    got = jax.jit(lambda: run(pingpong))()
    cooperative = jax.jit(lambda: run(GroupedGemmConfig()))() if compiled else None
  valid = np.asarray(layout.row_valid())
  assert _rows_err(jnp.sum(got[2], 1), d_s, layout) < 1e-2
  for i, (g, w) in enumerate(zip(got, want)):
    if w is not None:
      assert _rows_err(g, w, layout) < 1e-2
    if compiled:
      np.testing.assert_array_equal(np.asarray(g, np.float32)[valid],
                                    np.asarray(cooperative[i], np.float32)[valid])


def test_pingpong_takes_whole_tiles_and_halved_blocks():
  """A pingpong warpgroup holds a whole tile's rows: dH halves its column block (same accumulator
  registers); the roles and layouts without a pingpong form refuse it by name."""
  from sonic_jax.mosaic_gpu import down_projection as down
  from sonic_jax.mosaic_gpu import dh_projection as dh
  from sonic_jax.mosaic_gpu import dx_projection as dx
  from sonic_jax.mosaic_gpu import up_projection as up
  from sonic_jax.mosaic_gpu.grouped_gemm import GroupedGemmConfig
  pingpong = GroupedGemmConfig(schedule="pingpong")
  assert pingpong.rows_per_warpgroup == 128 and GroupedGemmConfig().rows_per_warpgroup == 64
  for config in (up.UpProjectionConfig, down.DownProjectionConfig, dx.DxProjectionConfig):
    with pytest.raises(ValueError, match="cooperative"):
      config(pingpong)
  with pytest.raises(ValueError, match="block_n=128"):
    dh.DhProjectionConfig(gemm=pingpong, block_n=256)
  # The roles that gather their rows run unclustered.
  with pytest.raises(ValueError, match=r"dH runs unclustered \(cluster_m=1\), got cluster_m=2"):
    dh.DhProjectionConfig(gemm=GroupedGemmConfig(cluster_m=2))
  with pytest.raises(ValueError, match=r"up-projection runs unclustered \(cluster_m=1\)"):
    up.UpProjectionConfig(GroupedGemmConfig(cluster_m=2))
  with pytest.raises(ValueError, match="schedule"):
    GroupedGemmConfig(schedule="alternate")
  with pytest.raises(ValueError, match="grid_band"):
    GroupedGemmConfig(grid_band="k")
  # A pingpong dH reads H into registers: the interleaved layout's pair words need SMEM.
  layout = _layout(jnp.zeros((64, 2), jnp.int32), 2, 128)
  spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  with pytest.raises(ValueError, match="concat"):
    jax.eval_shape(lambda g, h, s, w: dh.dh_projection(
        g, h, s, w, layout, acts.get_activation("swiglu"), gate_up_layout="interleaved",
        config=dh.DhProjectionConfig(pingpong)),
        spec(64, 256), spec(layout.num_rows, 256),
        spec(layout.num_rows, dtype=jnp.float32), spec(2, 128, 256))


LAYER_CASES = [("geglu", False, jnp.float16, "interleaved")]


def _with_modes(cases, compiled_only=()):
  """pytest params (compiled, *case) for each mode, plus `compiled_only` cases on the GPU."""
  name = lambda case: "-".join(getattr(v, "__name__", str(v)) for v in case)
  return ([pytest.param(False, *c, id=f"interpret-{name(c)}") for c in cases]
          + [pytest.param(True, *c, id=f"compiled-{name(c)}", marks=MODES[1].marks)
             for c in tuple(cases) + tuple(compiled_only)])


@pytest.mark.parametrize("compiled,activation,bias,dtype,gate_up_layout", _with_modes(
    LAYER_CASES,
    # on the GPU also swiglu with biases (interpreted: the token-rounding layer test, the same
    # layer with extra and dropped pairs), a non-GLU activation (interpreted: the gather-sum layer
    # test), SonicMoE's own layout with biases (CI's interpreter time goes elsewhere), and the
    # clamped SwiGLU and GELU-tanh GLU (interpreted: their up and dH kernels against the reference)
    compiled_only=[("swiglu", True, jnp.bfloat16, "concat"),
                   ("relu", False, jnp.bfloat16, "concat"),
                   ("swiglu", True, jnp.bfloat16, "interleaved"),
                   ("clamped_swiglu", True, jnp.bfloat16, "interleaved"),
                   ("geglu_tanh", False, jnp.bfloat16, "concat")]))
def test_moe_layer_against_oracle(rng, compiled, activation, bias, dtype, gate_up_layout):
  """sonic_jax.moe(backend="mosaic_gpu"): output and every gradient against the float64 oracle."""
  _check_layer(rng, compiled, activation, bias, dtype, gate_up_layout)


@pytest.mark.slow
@pytest.mark.parametrize("compiled", MODES)
def test_moe_layer_aggregation_kernel_against_oracle(rng, compiled, monkeypatch):
  """A Config whose thresholds take the gather-sum kernel for the forward's weighted sum at K = 2
  and d = 256 (the defaults: K >= 16, d >= 4096), inside the layer's custom_vjp under jit and
  grad: output and every gradient against the float64 oracle; with gather_sum_kernel=False the
  kernel never runs."""
  from sonic_jax.mosaic_gpu import backend
  calls = []
  kernel = backend.gs.gather_sum
  monkeypatch.setattr(backend.gs, "gather_sum", lambda *a: (calls.append(1), kernel(*a))[1])
  config = sonic_jax.Config(gather_sum_kernel_min_slots=1, gather_sum_kernel_min_d=1)
  _check_layer(rng, compiled, "relu", False, jnp.bfloat16, "concat", config)
  assert calls
  calls.clear()
  # The choice is made as the layer is traced: the forward and backward traced (not run) suffice.
  x, w1 = jnp.zeros((96, 256), jnp.bfloat16), jnp.zeros((4, 256, 256), jnp.bfloat16)
  w2 = jnp.zeros((4, 256, 256), jnp.bfloat16)
  layer = lambda x, w1, w2: jnp.sum(sonic_jax.moe(
      x, jnp.zeros((256, 4)), w1, w2, top_k=2, activation="relu", backend="mosaic_gpu",
      config=sonic_jax.Config(gather_sum_kernel=False))[0].astype(jnp.float32))
  with kernel_mode(compiled, detect_races=False):
    jax.eval_shape(jax.grad(layer, argnums=(0, 1, 2)), x, w1, w2)
  assert not calls


def _check_layer(rng, compiled, activation, bias, dtype, gate_up_layout, config=None):
  T, d, n, E = (96, 64, 128, 4) if not compiled else (2048, 256, 256, 8)
  n = n if sonic_jax.ACTIVATIONS[activation].is_glu else 2 * n
  if not sonic_jax.ACTIVATIONS[activation].is_glu or dtype == jnp.float16:
    d = 256  # the down-projection and dX kernels take d in multiples of 256: every kernel runs
  p, d_y = make_problem(rng, T=T, d=d, n=n, E=E, K=2, activation=activation, bias=bias)
  cast = {k: None if v is None else jnp.asarray(v, dtype) for k, v in p.items()}
  seen = {k: None if v is None else np.asarray(v.astype(jnp.float32), np.float64)
          for k, v in cast.items()}
  names = [k for k in ("x", "router_weight", "w1", "w2", "b1", "b2") if cast[k] is not None]

  def loss(*flat):
    a = dict(cast, **dict(zip(names, flat)))
    y, _ = sonic_jax.moe(a["x"], a["router_weight"], a["w1"], a["w2"], b1=a["b1"], b2=a["b2"],
                         top_k=2, activation=activation, gate_up_layout=gate_up_layout,
                         backend="mosaic_gpu", config=config)
    return jnp.vdot(y.astype(jnp.float32), jnp.asarray(d_y, jnp.float32)), y

  # Every kernel's own interpret-mode test runs the race detector; the layer tests, which run the
  # same kernels end to end, skip it (it multiplies the interpreter's time).
  with kernel_mode(compiled, detect_races=False):
    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(names))),
                                               has_aux=True))(*[cast[k] for k in names])
  ids = select_experts(seen["x"], seen["router_weight"], 2)
  y_ref, g_ref = reference_values_and_grads(seen, d_y, ids, routing="softmax_topk",
                                            activation=activation, gate_up_layout=gate_up_layout)
  errs = {"y": rel_err(y, y_ref), **{k: rel_err(g, g_ref[k]) for k, g in zip(names, grads)}}
  assert all(v < 2e-2 for v in errs.values()), errs


@pytest.mark.gpu
@pytest.mark.parametrize("x64", [False, True])
def test_layers_in_scan_under_checkpoint(rng, x64):
  """Compiled (the interpreter's io_callbacks take no jax.checkpoint): two layers in a lax.scan,
  each under jax.checkpoint, with token rounding (the Pallas routing kernels run too), against
  the same layers unrolled without remat: output and gradients; with jax_enable_x64 on too."""
  if not ON_GPU:
    pytest.skip("needs a GPU")
  L, T, d, n, E = 2, 2048, 256, 256, 8
  x = jnp.asarray(rng.standard_normal((T, d)), jnp.bfloat16)
  params = (jnp.asarray(rng.standard_normal((L, d, E)) / 16, jnp.bfloat16),
            jnp.asarray(rng.standard_normal((L, E, d, 2 * n)) / 16, jnp.bfloat16),
            jnp.asarray(rng.standard_normal((L, E, n, d)) / 16, jnp.bfloat16))

  def layer(h, p):
    y, _ = sonic_jax.moe(h, *p, top_k=2, token_rounding="nearest", backend="mosaic_gpu")
    return h + y

  def scanned(x, params):
    return jnp.sum(jax.lax.scan(lambda h, p: (jax.checkpoint(layer)(h, p), None), x,
                                params)[0].astype(jnp.float32) ** 2)

  def unrolled(x, params):
    for i in range(L):
      x = layer(x, [p[i] for p in params])
    return jnp.sum(x.astype(jnp.float32) ** 2)

  with jax.enable_x64(x64):
    got = jax.jit(jax.value_and_grad(scanned, argnums=(0, 1)))(x, params)
    want = jax.jit(jax.value_and_grad(unrolled, argnums=(0, 1)))(x, params)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
    assert rel_err(g, w) < 1e-2, rel_err(g, w)


@pytest.mark.gpu
def test_float64_with_token_rounding_under_x64(rng):
  """Compiled, jax_enable_x64 on: float64 inputs with token rounding take the XLA fallbacks and
  the Triton routing kernels (the extras fold in float64) and equal the xla backend."""
  if not ON_GPU:
    pytest.skip("needs a GPU")
  from sonic_jax.mosaic_gpu.backend import FallbackWarning
  T, d, n, E = 2048, 256, 256, 8
  with jax.enable_x64(True), warnings.catch_warnings():
    warnings.simplefilter("ignore", FallbackWarning)
    x = jnp.asarray(rng.standard_normal((T, d)))
    rw = jnp.asarray(rng.standard_normal((d, E)) / 16)
    w1 = jnp.asarray(rng.standard_normal((E, d, 2 * n)) / 16)
    w2 = jnp.asarray(rng.standard_normal((E, n, d)) / 16)
    run = lambda backend: jax.jit(jax.value_and_grad(lambda x, w1: jnp.sum(sonic_jax.moe(
        x, rw, w1, w2, top_k=2, token_rounding="nearest", backend=backend)[0] ** 2),
                                                     argnums=(0, 1)))(x, w1)
    got, want = run("mosaic_gpu"), run("xla")
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == jnp.float64 and rel_err(g, w) < 1e-8, (g.dtype, rel_err(g, w))


@pytest.mark.gpu
def test_vmap_over_a_batch_split_over_gpus(rng):
  """On 2 GPUs: `moe` vmapped over a batch split over an Explicit mesh axis. The xla backend (the
  Pallas routing kernels with it) equals the unsplit vmap; mosaic_gpu, and token rounding (its
  Triton selection), refuse such a batch by name."""
  if not ON_GPU or len(jax.devices()) < 2:
    pytest.skip("needs 2 GPUs")
  B, T, d, n, E = 2, 1024, 256, 128, 8
  x = jnp.asarray(rng.standard_normal((B, T, d)), jnp.bfloat16)
  rw = jnp.asarray(rng.standard_normal((d, E)) / 16, jnp.bfloat16)
  w1 = jnp.asarray(rng.standard_normal((E, d, 2 * n)) / 16, jnp.bfloat16)
  w2 = jnp.asarray(rng.standard_normal((E, n, d)) / 16, jnp.bfloat16)
  run = lambda backend, rounding=None: jax.jit(jax.vmap(lambda xb: sonic_jax.moe(
      xb, rw, w1, w2, top_k=2, token_rounding=rounding, backend=backend)[0]))
  mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:2])
  want = run("xla")(x)
  with jax.set_mesh(mesh):
    split = jax.device_put(x, jax.sharding.PartitionSpec("data"))
    got = run("xla")(split)
    for backend, rounding in (("mosaic_gpu", None), ("xla", "nearest")):
      with pytest.raises(ValueError, match="split over the mesh axes"):
        run(backend, rounding)(split)
  assert rel_err(got, want) < 1e-2, rel_err(got, want)


def test_mosaic_backend_refuses_a_non_hopper_device():
  if ON_GPU:
    pytest.skip("CPU-only check")
  with pytest.raises(ValueError, match="sm90"):
    sonic_jax.moe(jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((64, 4)),
                  jnp.zeros((4, 64, 256), jnp.bfloat16), jnp.zeros((4, 128, 64), jnp.bfloat16),
                  top_k=2, backend="mosaic_gpu")


def test_interpreter_warns_when_the_cpu_pool_is_too_small(monkeypatch):
  """A CPU client with fewer than 8 threads can hang the interpreter: the kernels say so when they
  are traced for interpret mode (this suite runs with PJRT_NPROC=16, set in conftest.py)."""
  from sonic_jax import interpret
  from sonic_jax.mosaic_gpu import down_projection as down
  assert interpret.cpu_client_threads() >= interpret.MIN_CPU_THREADS
  monkeypatch.setenv("PJRT_NPROC", "2")
  assert interpret.cpu_client_threads() == 2
  if ON_GPU:
    return
  layout = _layout(jnp.zeros((128, 1), jnp.int32), 1, 128)
  a, w2 = jnp.zeros((layout.num_rows, 128), jnp.bfloat16), jnp.zeros((1, 128, 256), jnp.bfloat16)
  trace = lambda: jax.eval_shape(lambda a, w2: down.down_projection(a, w2, None, layout), a, w2)
  with kernel_mode(False), pytest.warns(RuntimeWarning, match="PJRT_NPROC=16"):
    trace()
  monkeypatch.setenv("PJRT_NPROC", "16")
  with kernel_mode(False), warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    trace()


@pytest.mark.parametrize("compiled", MODES)
@pytest.mark.parametrize("activation,layout,dtype,n", [
    ("swiglu", "interleaved", jnp.bfloat16, 192),  # n not a multiple of 128: up and dH fall back
    ("gelu", "concat", jnp.float32, 256),  # float32: both projections fall back
])
def test_moe_layer_fallbacks_stay_correct(rng, compiled, activation, layout, dtype, n):
  from sonic_jax.mosaic_gpu import down_projection as down
  from sonic_jax.mosaic_gpu import up_projection as up
  T, d = 64, 256
  p, d_y = make_problem(rng, T=T, d=d, n=n, E=4, K=2, activation=activation)
  cast = {k: None if v is None else jnp.asarray(v, dtype) for k, v in p.items()}
  act = acts.get_activation(activation)
  assert up.supports(cast["x"], cast["w1"], act, layout) is not None  # the case is a fallback
  if dtype == jnp.float32:
    assert down.supports(cast["x"], cast["w2"]) is not None
  # float32 at full precision: XLA's GPU default for float32 dots is TF32 (~1e-3 relative).
  from sonic_jax.mosaic_gpu.backend import FallbackWarning
  # A layer test: the kernels' own tests run the race detector (see the oracle test's note).
  names = ("x", "router_weight", "w1", "w2")

  def loss(*args):
    y, _ = sonic_jax.moe(*args, top_k=2, activation=activation, gate_up_layout=layout,
                         backend="mosaic_gpu")
    return jnp.vdot(y.astype(jnp.float32), jnp.asarray(d_y, jnp.float32)), y

  # the backward too: its roles (dH, and in float32 dX and the weight gradients) fall back as well
  with kernel_mode(compiled, detect_races=False), jax.default_matmul_precision("highest"), \
      pytest.warns(FallbackWarning, match="up-projection runs on the xla path"):
    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        *[cast[k] for k in names])
  seen = {k: None if v is None else np.asarray(v.astype(jnp.float32), np.float64)
          for k, v in cast.items()}
  ids = select_experts(seen["x"], seen["router_weight"], 2)
  y_ref, g_ref = reference_values_and_grads(seen, d_y, ids, routing="softmax_topk",
                                            activation=activation, gate_up_layout=layout)
  errs = {"y": rel_err(y, y_ref), **{k: rel_err(g, g_ref[k]) for k, g in zip(names, grads)}}
  assert all(v < (2e-2 if dtype == jnp.bfloat16 else 2e-5) for v in errs.values()), errs


# Interpreted, "nearest" only: its layout has both the extra pairs of "up" and dropped ones (the
# backend sees no other difference; test_token_rounding.py checks each mode's routing), with
# biases (the swiglu layer case of test_moe_layer_against_oracle, interpreted here).
@pytest.mark.parametrize("mode,bias,compiled", [
    pytest.param("up", False, True, id="up-compiled", marks=pytest.mark.gpu),
    pytest.param("nearest", True, False, id="nearest-interpret"),
    pytest.param("nearest", False, True, id="nearest-compiled", marks=pytest.mark.gpu)])
def test_moe_layer_token_rounding_against_oracle(rng, compiled, mode, bias):
  """Token rounding on the mosaic_gpu backend (128-row tiles): output and gradients vs the oracle."""
  from oracle import reference_values_and_grads_masks, token_rounding_reference
  # Interpreted: 10 pairs added and 10 dropped over 4 tiles.
  T, d, n, E, K = (256, 64, 128, 4, 2) if not compiled else (3000, 256, 256, 16, 2)
  p, d_y = make_problem(rng, T=T, d=d, n=n, E=E, K=K, bias=bias)
  cast = {k: None if v is None else jnp.asarray(v, jnp.bfloat16) for k, v in p.items()}
  seen = {k: None if v is None else np.asarray(v.astype(jnp.float32), np.float64)
          for k, v in cast.items()}
  names = [k for k in ("x", "router_weight", "w1", "w2", "b1", "b2") if cast[k] is not None]

  def loss(*flat):
    a = dict(zip(names, flat))
    y, aux = sonic_jax.moe(a["x"], a["router_weight"], a["w1"], a["w2"], b1=a.get("b1"),
                           b2=a.get("b2"), top_k=K, token_rounding=mode, backend="mosaic_gpu")
    return jnp.vdot(y.astype(jnp.float32), jnp.asarray(d_y, jnp.float32)), (y, aux)

  with kernel_mode(compiled, detect_races=False):  # a layer test, as the oracle test's note says
    (_, (y, aux)), grads = jax.jit(jax.value_and_grad(
        loss, argnums=tuple(range(len(names))), has_aux=True))(*[cast[k] for k in names])
  assert np.all(np.asarray(aux.expert_counts) % 128 == 0) and int(aux.padded_rows) == 0
  probs = np.asarray(jax.nn.softmax(aux.router_logits, axis=-1), np.float64)
  tc, kept, added = token_rounding_reference(probs, K, 128, mode)
  assert added.any() and (mode == "up" or (tc & ~kept).any())
  y_ref, g_ref = reference_values_and_grads_masks(seen, d_y, tc, kept, added,
                                                  activation="swiglu", gate_up_layout="concat")
  errs = {"y": rel_err(y, y_ref), **{k: rel_err(g, g_ref[k]) for k, g in zip(names, grads)}}
  assert all(v < 2e-2 for v in errs.values()), errs


DH_CASES = [
    # (T, d, n, E, K, activation, skew, block_n, gate_up_layout)
    (90, 64, 128, 3, 2, CLAMPED, True, 128, "interleaved"),
    (70, 64, 256, 2, 2, CLAMPED, False, 256, "concat"),
    (60, 64, 256, 2, 2, "geglu_tanh", False, 256, "interleaved"),
    (100, 64, 128, 3, 2, "swiglu", False, 128, "concat"),
    (80, 128, 128, 4, 2, "geglu", True, 128, "concat"),
    (60, 64, 256, 2, 1, "gelu", False, 128, "concat"),
    (70, 64, 128, 3, 2, "relu_sq", True, 128, "concat"),
    (90, 64, 256, 3, 2, "swiglu", True, 256, "concat"),
    (50, 64, 256, 2, 2, "silu", False, 256, "concat"),
    (90, 64, 256, 3, 2, "swiglu", True, 128, "interleaved"),
    (70, 64, 256, 2, 2, "geglu", False, 256, "interleaved"),
]
DH_NAMES = "T,d,n,E,K,activation,skew,block_n,gate_up_layout"


# Interpreted, all but swiglu (128, concat), which the layer's token-rounding test runs against
# the oracle (swiglu's epilogue: two other cases), swiglu (256, concat), which
# test_dh_wide_tile_h_loads_agree runs on the same problem against the reference, and geglu (256,
# interleaved): geglu is the (80, ...) case, geglu_tanh (its tanh form) the 256-column interleaved
# one, and the layer test runs geglu's interleaved dH against the oracle.
@pytest.mark.parametrize(f"{DH_NAMES},compiled",
                         _cases_in_modes(DH_NAMES, DH_CASES, [3, 7, 10]))
def test_dh_projection_matches_reference(rng, compiled, T, d, n, E, K, activation, skew, block_n,
                                         gate_up_layout):
  """dH, A_s and dS (its partials summed) against the xla role, rows of the layout in use; dO's
  rows gathered by the kernel; H prefetched into SMEM (128-column blocks) or staged through it a
  piece at a time (256); both gate/up layouts."""
  from sonic_jax.mosaic_gpu import dh_projection as dh
  if compiled:
    T, d, E = T * 40, d * 4, E * 4
  act = acts.get_activation(activation)
  _, _, _, ids = _problem(rng, T, d, n, E, K, activation, skew)
  layout = _layout(ids, E, 128)
  rows = layout.num_rows
  h = jnp.asarray(rng.standard_normal((rows, act.width_multiplier() * n)), jnp.bfloat16)
  d_out = jnp.asarray(rng.standard_normal((T, d)), jnp.bfloat16)
  w2 = jnp.asarray(rng.standard_normal((E, n, d)) / np.sqrt(d), jnp.bfloat16)
  scores = jnp.where(layout.row_valid(), jnp.asarray(rng.uniform(0.1, 1.0, rows), jnp.float32), 0.0)
  with kernel_mode(compiled):
    config = dh.DhProjectionConfig(block_n=block_n)
    d_h, a_s, ds_parts = jax.jit(lambda *a: dh.dh_projection(
        *a, layout, act, config=config, gate_up_layout=gate_up_layout))(d_out, h, scores, w2)
  d_h_ref, a_s_ref, d_s_ref, _ = xla_backend.dh_projection(d_out, h, scores, w2, None, layout,
                                                           act, gate_up_layout)
  assert ds_parts.shape == (n // block_n, rows)
  assert _rows_err(d_h, d_h_ref, layout) < 1e-2
  assert _rows_err(a_s, a_s_ref, layout) < 1e-2
  assert _rows_err(jnp.sum(ds_parts, 0), d_s_ref, layout) < 1e-2


@pytest.mark.parametrize("compiled", MODES)
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_dh_wide_tile_h_loads_agree(rng, compiled, activation):
  """The 256-column tile's two ways of reading H in the epilogue (staged through SMEM, or loaded
  into registers) give the same dH, A_s and dS partials bit for bit (they differ only in where H
  and the outputs pass), with a skewed routing and an empty expert; the staged one also runs the
  shallower ring it needs. Interpreted, they also match the XLA reference (as the dH test
  checks its cases)."""
  from sonic_jax.mosaic_gpu import dh_projection as dh
  T, d, n, E = (90, 64, 256, 3) if not compiled else (3600, 256, 512, 12)
  act = acts.get_activation(activation)
  _, _, _, ids = _problem(rng, T, d, n, E, 2, activation, skew=True)
  layout = _layout(ids, E, 128)
  h = jnp.asarray(rng.standard_normal((layout.num_rows, act.width_multiplier() * n)), jnp.bfloat16)
  d_out = jnp.asarray(rng.standard_normal((T, d)), jnp.bfloat16)
  w2 = jnp.asarray(rng.standard_normal((E, n, d)) / np.sqrt(d), jnp.bfloat16)
  scores = jnp.where(layout.row_valid(), jnp.asarray(rng.uniform(0.1, 1.0, layout.num_rows),
                                                     jnp.float32), 0.0)
  run = lambda loads: jax.jit(lambda *a: dh.dh_projection(
      *a, layout, act, config=dh.DhProjectionConfig(block_n=256, wide_h_loads=loads)))(
          d_out, h, scores, w2)
  with kernel_mode(compiled):
    staged, registers = run("staged"), run("registers")
  used = int(layout.num_tiles) * 128
  in_use = lambda v: v[:used] if v.shape[0] == layout.num_rows else v[:, :used]  # dS: (blocks, R)
  for g, w in zip(staged, registers):
    g, w = np.asarray(in_use(g), np.float32), np.asarray(in_use(w), np.float32)
    assert np.all(np.isfinite(w)) and np.abs(w).max() > 0
    np.testing.assert_array_equal(g, w)
  if not compiled:
    d_h_ref, a_s_ref, d_s_ref, _ = xla_backend.dh_projection(d_out, h, scores, w2, None, layout,
                                                             act, "concat")
    assert _rows_err(staged[0], d_h_ref, layout) < 1e-2
    assert _rows_err(staged[1], a_s_ref, layout) < 1e-2
    assert _rows_err(jnp.sum(staged[2], 0), d_s_ref, layout) < 1e-2


# Interpreted at width 512 (two passes over the operand ring): the layer's gather-sum test runs the
# kernel at width 256 (d = 256) against the oracle, and the walk test's dX case too.
@pytest.mark.parametrize("width,compiled", _cases_in_modes("width", [(256,), (512,)], [0]))
def test_dx_projection_matches_reference(rng, compiled, width):
  from sonic_jax.mosaic_gpu import dx_projection as dx
  T, d, E = (90, 256, 3) if not compiled else (4000, 1024, 16)
  ids = jnp.asarray(rng.integers(0, E, (T, 2)), jnp.int32)
  layout = _layout(ids, E, 128)
  d_h = jnp.asarray(rng.standard_normal((layout.num_rows, width)), jnp.bfloat16)
  w1 = jnp.asarray(rng.standard_normal((E, d, width)) / np.sqrt(width), jnp.bfloat16)
  with kernel_mode(compiled):
    got = jax.jit(lambda a, w: dx.dx_projection(a, w, layout))(d_h, w1)
  assert _rows_err(got, xla_backend.dx_projection(d_h, w1, layout), layout) < 1e-2


WG_NAMES = "m,n,skew,cluster,block,transposed"


# Interpreted, all but the first (the default config at m = 128, n = 256):
# test_weight_grad_stops_at_the_last_real_row runs that kernel against the reference.
@pytest.mark.parametrize(f"{WG_NAMES},compiled", _cases_in_modes(WG_NAMES, [
    (128, 256, False, 1, (128, 256), False), (256, 512, True, 1, (128, 256), False),
    (256, 256, True, 2, (128, 256), False), (256, 256, True, 2, (128, 256), True),
    (256, 256, True, 1, (128, 128), False), (128, 256, False, 1, (128, 256), True)], [0]))
def test_weight_grad_matches_reference(rng, compiled, m, n, skew, cluster, block, transposed):
  """Varlen-K out[e] = lhs_rows_e^T rhs_e with the lhs rows gathered by token inside the kernel
  (as dw1 = x_rows^T dH runs); experts without rows get exact zeros. cluster=2: 2-CTA clusters
  multicasting the rhs tile (pairs of m blocks). block (128, 128): dw2's narrow blocks.
  transposed: out[e]^T stored (E, n, m), the accumulators written through
  transposed staging buffers (as dw2 = (dO_rows^T A_s)^T runs)."""
  from sonic_jax.mosaic_gpu import weight_grad as wg
  T, E = (120, 4) if not compiled else (4000, 16)
  if compiled:
    m, n = m * 4, n * 2
  _, _, _, ids = _problem(rng, T, 64, 128, E, 2, "swiglu", skew)
  layout = _layout(ids, E, 128)
  valid = layout.row_valid()[:, None]
  # The grouped operand is zero on padding rows (as dH and A_s are); the gathered one is not.
  lhs = jnp.asarray(rng.standard_normal((T, m)), jnp.bfloat16)
  rhs = jnp.where(valid, jnp.asarray(rng.standard_normal((layout.num_rows, n)), jnp.bfloat16), 0)
  with kernel_mode(compiled):
    got = jax.jit(lambda a, b: wg.weight_grad(
        a, b, layout, wg.WeightGradConfig(block_n=block[1], cluster=cluster),
        transpose_out=transposed))(lhs, rhs)
  want = xla_backend.grouped_weight_grad(lhs[layout.row_token], rhs, layout)
  if transposed:
    want = want.swapaxes(1, 2)
  assert got.shape == want.shape == ((E, n, m) if transposed else (E, m, n))
  assert got.dtype == jnp.bfloat16
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  assert rel_err(got, want) < 1e-2
  empty = np.asarray(layout.expert_counts) == 0
  assert empty.any() == skew
  assert np.all(np.asarray(got, np.float32)[empty] == 0)


def _routing_with_counts(rng, counts):
  """(T, 1) expert ids, shuffled, that give expert e exactly counts[e] rows."""
  ids = np.repeat(np.arange(len(counts)), counts)
  return jnp.asarray(rng.permutation(ids)[:, None], jnp.int32)


def _rows_past_the_reduction(layout, tile_k=64):
  """(R,) bool: grouped rows after the tile_k step that holds their expert's last real row."""
  sizes = np.asarray(layout.group_sizes)
  start = np.append(np.cumsum(sizes) - sizes, 0)  # per expert, then 0 for rows past the used ones
  reduced = np.append(-(-np.asarray(layout.expert_counts) // tile_k) * tile_k, 0)
  expert = np.asarray(layout.row_expert)  # E past the used rows
  offset = np.arange(layout.num_rows) - start[expert]
  return (expert < layout.num_experts) & (offset >= reduced[expert])


# Experts' rows: a lone tile of 40 (its second 64-row step padding only), 64 + 128 (the same in its
# last tile), 65 (one real row in the second step), none, and full tiles.
SKIP_COUNTS = [40, 192, 65, 0, 256]


@pytest.mark.parametrize("compiled", MODES)
def test_weight_grad_stops_at_the_last_real_row(rng, compiled):
  """The varlen-K reduction ends with the 64-row step that holds an expert's last real row: NaN in
  the padding-only steps after it (in the grouped rhs; the gathered lhs's padding rows read a
  real token) never reaches the gradient."""
  from sonic_jax.mosaic_gpu import weight_grad as wg
  m, n, scale = (128, 256, 1) if not compiled else (512, 512, 8)
  counts = [c * scale for c in SKIP_COUNTS]
  layout = _layout(_routing_with_counts(rng, counts), len(counts), 128)
  skipped = _rows_past_the_reduction(layout)[:, None]
  valid = np.asarray(layout.row_valid())[:, None]
  assert skipped.any()

  def grouped(width):  # zero on the padding rows that the reduction reads, NaN past them
    v = rng.standard_normal((layout.num_rows, width))
    return jnp.asarray(np.where(valid, v, np.where(skipped, np.nan, 0)), jnp.bfloat16)

  rhs = grouped(n)
  lhs = jnp.asarray(rng.standard_normal((sum(counts), m)), jnp.bfloat16)
  lhs_rows = lhs[layout.row_token]
  with kernel_mode(compiled):
    got = jax.jit(lambda a, b: wg.weight_grad(a, b, layout))(lhs, rhs)
  zeroed = lambda v: jnp.where(valid, v, 0)
  want = xla_backend.grouped_weight_grad(zeroed(lhs_rows), zeroed(rhs), layout)
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("compiled", MODES)
def test_weight_grad_padding_reads_its_experts_token(rng, compiled):
  """The reduction's last step multiplies its padding rows by zero (the grouped rhs is zero
  there), and the gathered lhs reads each padding row from a token of the row's own expert
  (layout.py): a NaN in one token's row reaches only its expert's gradient, not every padded
  expert's."""
  from sonic_jax.mosaic_gpu import weight_grad as wg
  m, n, scale = (128, 256, 1) if not compiled else (512, 512, 8)
  # every expert with rows pads its last 64-row step
  counts = [c * scale + (c > 0) * (scale > 1) for c in (40, 65, 0, 100)]
  ids = np.array(_routing_with_counts(rng, counts))
  ids[[0, np.argmax(ids[:, 0] == 3)], 0] = 3, ids[0, 0]  # token 0 is expert 3's
  layout = _layout(jnp.asarray(ids), len(counts), 128)
  valid = np.asarray(layout.row_valid())[:, None]
  rhs = jnp.asarray(np.where(valid, rng.standard_normal((layout.num_rows, n)), 0), jnp.bfloat16)
  lhs = jnp.asarray(rng.standard_normal((sum(counts), m)), jnp.bfloat16).at[0, 5].set(jnp.nan)
  with kernel_mode(compiled):
    got = np.asarray(jax.jit(lambda a, b: wg.weight_grad(a, b, layout))(lhs, rhs), np.float32)
  assert np.isnan(got[3]).any()
  assert np.all(np.isfinite(got[:3]))
  zeroed = lambda v: jnp.where(valid, v, 0)
  want = xla_backend.grouped_weight_grad(zeroed(lhs[layout.row_token]), zeroed(rhs), layout)
  assert rel_err(got[:3], want[:3]) < 1e-2


# (role, variant): the roles that run 2-CTA clusters (not those that gather their rows: up, dH),
# and the row-band tile walk (with and without clusters).
WALK_CASES = ([(role, "cluster") for role in ["down", "dx"]]
              + [(role, "m_band") for role in ["up", "down", "dh", "dx"]]
              + [("dx", "m_band+cluster")])
# Bands of 3 (not a power of two: planar_snake's branchless path) over 8 row tiles or 4 tile pairs
# on the CPU: the last band is partial.
WALK_VARIANTS = {"cluster": {"cluster_m": 2}, "m_band": {"grid_band": "m", "grid_tile_width": 3},
                 "m_band+cluster": {"grid_band": "m", "grid_tile_width": 3, "cluster_m": 2}}
# Interpreted, a subset: the walk is the core's (`grouped_gemm`'s tile loop), the same for every
# role, so each variant at least once, over a gathered A (dH), a plain one (down) and a
# transposed B (dX); compiled, every case.
WALK_INTERPRETED = [("down", "cluster"), ("down", "m_band"), ("dh", "m_band"),
                    ("dx", "m_band+cluster")]
WALK_PARAMS = ([pytest.param(role, variant, False, id=f"{role}-{variant}-interpret")
                for role, variant in WALK_INTERPRETED]
               + [pytest.param(role, variant, True, id=f"{role}-{variant}-compiled",
                               marks=pytest.mark.gpu) for role, variant in WALK_CASES])


@pytest.mark.parametrize("role,variant,compiled", WALK_PARAMS)
def test_walk_variants_equal_default(rng, compiled, role, variant):
  """Other tile walks compute the same tiles as the default one: bit-identical outputs. 2-CTA
  clusters (`cluster_m=2`: tile pairs, B multicast where a pair shares its expert), with an odd
  number of tiles in use (the last pair's second CTA runs a dummy tile), pairs that straddle
  experts, a skewed expert and an empty one; the row-band walk (`grid_band="m"`: bands of 3 row
  tiles or tile pairs across every column block, the last band partial). The interpreter does
  not model multicast (each CTA loads the whole block there); the compiled run checks it."""
  from sonic_jax.mosaic_gpu import dh_projection as dh
  from sonic_jax.mosaic_gpu import down_projection as down
  from sonic_jax.mosaic_gpu import dx_projection as dx
  from sonic_jax.mosaic_gpu import up_projection as up
  from sonic_jax.mosaic_gpu.grouped_gemm import GroupedGemmConfig
  # Pairs per expert: tiles 1, 1, 3 and none (5 in use: a pair across experts, one within, a
  # dummy), or 81 tiles on the GPU.
  T, d, n, counts = ((230, 256, 128, [100, 100, 260, 0]) if not compiled else
                     (5000, 512, 256, [3000, 1300, 2300, 0, 1000, 1200, 700, 500]))
  E = len(counts)
  if not compiled and role in ("up", "dh"):  # the interpreted gathered kernels cost the most
    d = 128
  x, w1, _, _ = _problem(rng, T, d, n, E, 2, "swiglu")
  ids = jnp.asarray(rng.permutation(np.repeat(np.arange(E), counts)).reshape(T, 2), jnp.int32)
  layout = _layout(ids, E, 128)
  assert int(layout.num_tiles) % 2 == 1
  act = acts.get_activation("swiglu")
  w2 = jnp.asarray(rng.standard_normal((E, n, d)) / np.sqrt(n), jnp.bfloat16)
  rows = lambda w: jnp.asarray(rng.standard_normal((layout.num_rows, w)), jnp.bfloat16)
  a, h, d_h = rows(n), rows(2 * n), rows(2 * n)
  scores = jnp.where(layout.row_valid(), 0.5, 0.0).astype(jnp.float32)
  d_out = jnp.asarray(rng.standard_normal((T, d)), jnp.bfloat16)
  run = {
      "up": lambda c: up.up_projection(x, w1, None, layout, act, "concat",
                                       config=up.UpProjectionConfig(c)),
      "down": lambda c: down.down_projection(a, w2, None, layout, down.DownProjectionConfig(c)),
      "dh": lambda c: dh.dh_projection(d_out, h, scores, w2, layout, act,
                                       config=dh.DhProjectionConfig(c))[:2],
      "dx": lambda c: dx.dx_projection(d_h, w1, layout, dx.DxProjectionConfig(c)),
  }[role]
  with kernel_mode(compiled, num_cores=4):
    want = jax.jit(lambda: run(GroupedGemmConfig()))()
    got = jax.jit(lambda: run(GroupedGemmConfig(**WALK_VARIANTS[variant])))()
  valid = np.asarray(layout.row_valid())
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g, np.float32)[valid], np.asarray(w, np.float32)[valid]
    assert np.all(np.isfinite(w)) and np.abs(w).max() > 0
    np.testing.assert_array_equal(g, w)


def _lowering_cases():
  from sonic_jax.mosaic_gpu import dh_projection as dh
  from sonic_jax.mosaic_gpu import down_projection as down
  from sonic_jax.mosaic_gpu import dx_projection as dx
  from sonic_jax.mosaic_gpu import up_projection as up
  from sonic_jax.mosaic_gpu import weight_grad as wgrad
  from sonic_jax.mosaic_gpu.grouped_gemm import GroupedGemmConfig
  E, d, n, T = 4, 256, 256, 1000
  ids = jnp.asarray(np.random.default_rng(0).integers(0, E, (T, 2)), jnp.int32)
  layout = _layout(ids, E, 128)
  R, bf = layout.num_rows, jnp.bfloat16
  spec = lambda *shape, dtype=bf: jax.ShapeDtypeStruct(shape, dtype)
  dh_specs = lambda width: (spec(T, d), spec(R, width), spec(R, dtype=jnp.float32), spec(E, n, d))
  cases = {}
  for name in ("swiglu", "gelu", "relu_sq", "clamped_swiglu", "geglu_tanh"):
    act = acts.get_activation(name)
    width = act.width_multiplier() * n
    for gate_up in ("concat", "interleaved") if act.is_glu else ("concat",):
      suffix = "-interleaved" if gate_up == "interleaved" else ""
      cases[f"up-{name}{suffix}"] = (
          lambda x, w, b, act=act, gate_up=gate_up: up.up_projection(x, w, b, layout, act, gate_up),
          (spec(T, d), spec(E, d, width), spec(E, width)))
    if act.is_glu:
      for block_n in (128, 256):
        cases[f"dh-{name}-interleaved-{block_n}"] = (
            lambda a, h, s, w, act=act, block_n=block_n: dh.dh_projection(
                a, h, s, w, layout, act, config=dh.DhProjectionConfig(block_n=block_n),
                gate_up_layout="interleaved"), dh_specs(width))
    cases[f"dh-{name}"] = (lambda a, h, s, w, act=act: dh.dh_projection(a, h, s, w, layout, act),
                           dh_specs(width))
  swiglu = acts.get_activation("swiglu")
  for loads in ("staged", "registers"):
    cases[f"dh-swiglu-wide-{loads}"] = (
        lambda a, h, s, w, loads=loads: dh.dh_projection(
            a, h, s, w, layout, swiglu,
            config=dh.DhProjectionConfig(block_n=256, wide_h_loads=loads)), dh_specs(2 * n))
  cases["dh-swiglu-pingpong"] = (
      lambda a, h, s, w: dh.dh_projection(
          a, h, s, w, layout, swiglu,
          config=dh.DhProjectionConfig(GroupedGemmConfig(schedule="pingpong"), block_n=128)),
      dh_specs(2 * n))
  cases["down"] = (lambda a, w, b: down.down_projection(a, w, b, layout),
                   (spec(R, n), spec(E, n, d), spec(E, d)))
  cases["dx"] = (lambda g, w: dx.dx_projection(g, w, layout), (spec(R, 2 * n), spec(E, d, 2 * n)))
  cases["weight_grad"] = (lambda a, b: wgrad.weight_grad(a, b, layout), (spec(T, d), spec(R, 2 * n)))
  cases["weight_grad-indices_after_wait"] = (
      lambda a, b: wgrad.weight_grad(a, b, layout, wgrad.WeightGradConfig(
          indices_before_wait=False)), (spec(T, d), spec(R, 2 * n)))
  cases["weight_grad-transposed"] = (
      lambda a, b: wgrad.weight_grad(a, b, layout, transpose_out=True), (spec(T, d), spec(R, n)))
  cases["weight_grad-128x128-cluster"] = (
      lambda a, b: wgrad.weight_grad(a, b, layout, wgrad.WeightGradConfig(
          block_n=128, cluster=2)), (spec(T, d), spec(R, n)))
  # 2-CTA clusters with B multicast, in the roles that run them.
  cluster = GroupedGemmConfig(cluster_m=2)
  cases["down-cluster"] = (
      lambda a, w, b: down.down_projection(a, w, b, layout, down.DownProjectionConfig(cluster)),
      (spec(R, n), spec(E, n, d), spec(E, d)))
  cases["dx-cluster"] = (lambda g, w: dx.dx_projection(g, w, layout, dx.DxProjectionConfig(cluster)),
                         (spec(R, 2 * n), spec(E, d, 2 * n)))
  return cases


LOWERING_CASES = [
    "up-swiglu", "up-swiglu-interleaved", "up-gelu", "up-relu_sq",
    "up-clamped_swiglu-interleaved", "up-geglu_tanh", "dh-clamped_swiglu-interleaved-128",
    "dh-clamped_swiglu", "dh-geglu_tanh",
    "down", "down-cluster", "dx", "dx-cluster",
    "dh-swiglu", "dh-gelu", "dh-relu_sq", "dh-swiglu-interleaved-128", "dh-swiglu-interleaved-256",
    "dh-swiglu-wide-staged", "dh-swiglu-wide-registers", "dh-swiglu-pingpong",
    "weight_grad", "weight_grad-transposed", "weight_grad-indices_after_wait",
    "weight_grad-128x128-cluster"]


@pytest.mark.parametrize("role", LOWERING_CASES)
def test_kernel_lowers_for_sm90(role):
  """Each kernel lowers to Mosaic GPU for an H100 from this machine (`jax.export` for 'cuda'):
  layout inference and the kernel's static checks run without a GPU, so CI catches what the
  interpreter cannot (the interpreter never lowers)."""
  if ON_GPU:
    pytest.skip("CPU-side check")
  fn, args = _lowering_cases()[role]
  with jax.sharding.use_abstract_mesh(h100_abstract_mesh()):
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
  assert "mosaic_gpu" in exported.mlir_module()


def test_backend_lowers_under_x64():
  """With jax_enable_x64 on, the mosaic_gpu backend's roles (the expert op's forward and
  backward, bfloat16) lower for an H100: the kernels' index arithmetic stays int32."""
  if ON_GPU:
    pytest.skip("CPU-side check")
  from sonic_jax.backends import XLA
  from sonic_jax.experts import expert_mixture
  from sonic_jax.mosaic_gpu.backend import make_backend
  E, d, n, T = 4, 256, 256, 256
  layout = _layout(jnp.asarray(np.arange(2 * T).reshape(T, 2) % E, jnp.int32), E, 128)
  impl = make_backend(XLA, sonic_jax.Config())
  swiglu = acts.get_activation("swiglu")
  loss = lambda x, s, w1, w2: jnp.sum(expert_mixture(
      x, s, layout, w1, w2, activation=swiglu, backend=impl).astype(jnp.float32))
  bf = jnp.bfloat16
  args = (jax.ShapeDtypeStruct((T, d), bf), jax.ShapeDtypeStruct((T, 2), jnp.float32),
          jax.ShapeDtypeStruct((E, d, 2 * n), bf), jax.ShapeDtypeStruct((E, n, d), bf))
  with jax.enable_x64(True), jax.sharding.use_abstract_mesh(h100_abstract_mesh()):
    exported = jax.export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))),
                                 platforms=["cuda"])(*args)
  # up, down, dH, dX and the two weight gradients
  assert exported.mlir_module().count("custom_call @mosaic_gpu") == 6


# Interpreted at n = 384 (128 x 128 blocks): at n = 256 (128 x 256 blocks) this is the kernel call
# of test_weight_grad_matches_reference's (128, 256, ..., transposed) case (m = d = 128), and the
# layer's gather-sum test runs it (2-CTA clusters) against the oracle.
@pytest.mark.parametrize("n,compiled", _cases_in_modes("n", [(256,), (384,)], [0]))
def test_dw2_gathering_d_out_matches_reference(rng, compiled, n):
  """The backend's dw2 with the dO rows gathered on the wgmma's M side (dO_rows^T A_s stored
  transposed): (E, n, d) = A_s^T dO_rows per expert, 128 x 256 (d, n) blocks where n allows,
  else 128 x 128; experts without rows get zeros."""
  from sonic_jax.mosaic_gpu import backend as b
  from sonic_jax.mosaic_gpu import weight_grad as wg
  T, E, d = (120, 4, 128) if not compiled else (3000, 8, 512)
  ids = np.stack([rng.integers(0, E - 1, T), rng.integers(0, E - 1, T)], 1)  # the last: empty
  layout = _layout(jnp.asarray(ids, jnp.int32), E, 128)
  d_out = jnp.asarray(rng.standard_normal((T, d)), jnp.bfloat16)
  a_s = jnp.where(layout.row_valid()[:, None],
                  jnp.asarray(rng.standard_normal((layout.num_rows, n)), jnp.bfloat16), 0)
  with kernel_mode(compiled):
    got = jax.jit(lambda g, a: b.dw2_gathering_d_out(g, a, layout, wg.WeightGradConfig()))(
        d_out, a_s)
  want = xla_backend.grouped_weight_grad(a_s, d_out[layout.row_token], layout)
  assert got.shape == want.shape == (E, n, d) and got.dtype == jnp.bfloat16
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  assert rel_err(got, want) < 1e-2
  assert not np.any(np.asarray(got[E - 1], np.float32))


@pytest.mark.parametrize("field,value", [("block_n", 64), ("cluster", 4), ("num_stages", 0),
                                         ("indices_before_wait", 1)])
def test_weight_grad_config_rejects_unsupported_fields(field, value):
  from sonic_jax.mosaic_gpu import weight_grad as wg
  with pytest.raises(ValueError, match=field):
    wg.WeightGradConfig(**{field: value})


@pytest.mark.parametrize("gathers", [False, True])
def test_register_split_fits_the_launch(gathers):
  """setmaxnreg moves registers inside the pool the launch gave the CTA (168 per thread for
  3 warpgroups): a split that asks for more blocks forever on the GPU, so it must fit."""
  from sonic_jax.mosaic_gpu.grouped_gemm import register_split
  memory, compute = register_split(gathers)
  assert memory % 8 == 0 and compute % 8 == 0 and 24 <= memory <= compute <= 256
  assert memory + 2 * compute <= (65536 // 384) // 8 * 8 * 3
  # setmaxnreg's .dec lowers and .inc raises from the launch's 168: both hold at the bound
  assert register_split(gathers, 168) == (168, 168)
  with pytest.raises(ValueError, match=r"memory_registers must be a multiple of 8 in \[24, 168\]"):
    register_split(gathers, 176)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_pair_words_round_trip(rng, dtype):
  """The interleaved layout's (gate, up) words: packing rounds each float32 half to `dtype` and
  puts gate in the low 16 bits (the little-endian bytes of the interleaved H); unpacking gives
  the rounded values back exactly, specials included."""
  from sonic_jax.mosaic_gpu import epilogue as epi
  gate = rng.standard_normal((8, 32)).astype(np.float32) * 3
  up = rng.standard_normal((8, 32)).astype(np.float32)
  gate[0, :4] = [np.inf, -np.inf, 0.0, -0.0]
  up[0, :2] = [np.nan, 1e-8]
  words = epi.pack_pairs(jnp.asarray(gate), jnp.asarray(up), dtype)
  assert words.dtype == jnp.uint32
  interleaved = np.stack([gate, up], axis=-1).reshape(8, 64).astype(dtype)
  np.testing.assert_array_equal(np.asarray(words),
                                np.ascontiguousarray(interleaved).view(np.uint32))
  got_gate, got_up = epi.unpack_pairs(words, dtype)
  np.testing.assert_array_equal(np.asarray(got_gate), gate.astype(dtype).astype(np.float32))
  np.testing.assert_array_equal(np.asarray(got_up), up.astype(dtype).astype(np.float32))
