r"""The forward (or training step) of one layer called a few times, for Nsight Compute to read its
GEMM kernels' hardware counters; `tools/ncu_compare.sh` runs it under `ncu` for SonicMoE's layer
and sonic_jax's on one GPU.

  python3 -m tools.ncu_forward --impl=sonic_jax|sonicmoe --thiek=T,d,n,E,K [--calls=3]
      [--layout=concat|interleaved] [--tuning=TABLE.json] [--token_rounding=down|up|nearest]
      [--step]
  python3 -m tools.ncu_forward --summarize REPORT.csv[.gz] ...   (`ncu --import`'s raw CSVs)
  python3 -m tools.ncu_forward --stalls REPORT_sass.csv[.gz] ...  (source pages, NCU_SOURCE=1)

Timings cannot tell apart two kernels that run at the same speed on the same clocks but draw
different power; the counters can (DRAM and L2 bytes, instructions, shared-memory wavefronts).
Both layers take SonicMoE's input scales (x ~ 0.2 N(0, 1), weights of std 0.02). SonicMoE's needs
its bundle (`bash benchmarks/wheels.sh sonicmoe`, then `source benchmarks/wheels.sh install` on
the GPU machine).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import os
import re
import sys

# The counters printed side by side (where the report has them): time and clock, DRAM and L2
# bytes, instructions (all, cp.async, shared-memory), shared-memory wavefronts and bank
# conflicts, tensor-pipe activity, launch shape.
SUMMARY_METRICS = (
    "gpu__time_duration.sum", "sm__cycles_elapsed.avg.per_second", "sm__cycles_elapsed.max",
    "sm__pipe_tensor_cycles_active_realtime.avg.pct_of_peak_sustained_elapsed",
    "dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sectors.sum",
    "lts__t_sectors_lookup_miss.sum", "lts__t_sectors_srcunit_ltcfabric.sum",
    "lts__t_sector_hit_rate.pct", "l1tex__m_xbar2l1tex_read_bytes.sum",
    "l1tex__m_xbar2l1tex_read_bytes_mem_global_op_tma_ld.sum",
    "l1tex__m_l1tex2xbar_write_bytes.sum", "smsp__inst_executed.sum",
    "smsp__inst_executed_op_ldgsts.sum", "smsp__sass_inst_executed_op_shared_ld.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
    "smsp__warps_active.avg.per_cycle_active", "launch__registers_per_thread",
    "launch__grid_size", "launch__cluster_dim_x", "launch__shared_mem_per_block_dynamic")


def profiled(call, impl):
  """`call` with the CUDA profiler started around it: ncu runs with --profile-from-start off,
  so only this call's kernels are profiled (SonicMoE's warm-up calls may launch others)."""
  if impl == "sonicmoe":
    import torch
    start, stop = torch.cuda.profiler.start, torch.cuda.profiler.stop
  else:
    from cuda.bindings import runtime
    start, stop = runtime.cudaProfilerStart, runtime.cudaProfilerStop
  start()
  call()
  stop()


def layer_call(impl, cfg, layout, step, tuning=None, token_rounding=None):
  """One synchronised forward (or training step: forward and backward from a fixed dO) of
  SonicMoE's layer (`benchmarks.sonicmoe_bench.build`) or ours (`tuning`: a table's path;
  `token_rounding`: a mode of `sonic_jax.moe`, for its GEMMs on the rounded layout)."""
  if impl == "sonicmoe":
    import torch
    from benchmarks import sonicmoe_bench
    fwd, fwdbwd = sonicmoe_bench.build(cfg)
    fn = fwdbwd if step else fwd

    def call():
      fn()
      torch.cuda.synchronize()
    return call
  import jax
  import sonic_jax
  from benchmarks import grid, timing
  from sonic_jax.mosaic_gpu.tuning import TuningTable
  x, rw, w1, w2, d_out = grid.random_problem(cfg, data="sonicmoe")
  config = sonic_jax.Config(tuning=TuningTable.load(tuning) if tuning else None)
  fwd = lambda x, rw, w1, w2: sonic_jax.moe(x, rw, w1, w2, top_k=cfg[4], backend="mosaic_gpu",
                                            gate_up_layout=layout, config=config,
                                            token_rounding=token_rounding)[0]
  fn, args = (timing.forward_and_backward(fwd), (x, rw, w1, w2, d_out)) if step else (
      fwd, (x, rw, w1, w2))
  compiled = jax.jit(fn).lower(*args).compile()
  return lambda: jax.block_until_ready(compiled(*args))


def _open_csv(path):
  return gzip.open(path, "rt", newline="") if path.endswith(".gz") else open(path, newline="")


def read_raw_csv(path):
  """[{column: value}] per profiled kernel of `ncu --import R --csv --page raw --print-units base`
  (a header row, a units row, one row per kernel; gzipped if the path ends in .gz)."""
  with _open_csv(path) as f:
    rows = [row for row in csv.reader(f) if row]
  start = next(i for i, row in enumerate(rows) if "Kernel Name" in row)
  # Some columns carry their section's prefix ("TPC.TriageCompute.sm__..."): keyed by the metric.
  header = [re.sub(r"^[A-Za-z_]+\.[A-Za-z]+\.(?=[a-z0-9]+__)", "", h) for h in rows[start]]
  return [dict(zip(header, row)) for row in rows[start + 2:] if len(row) == len(header)]


_OUR_ROLES = (("up_projection", "up"), ("down_projection", "down"), ("dh_projection", "dH"),
              ("dx_projection", "dX"), ("weight_grad", "dw"))


def kernel_role(name):
  """A short role name for a GEMM kernel: ours by name; SonicMoE's gated GEMM is its
  up-projection, its dgated one dH, and its plain GEMMs are named 'gemm' (their order in the
  call tells them apart)."""
  for prefix, role in _OUR_ROLES:
    if name.startswith(prefix):
      return role
  if "GemmDGated" in name:
    return "dH"
  if "GemmGated" in name:
    return "up"
  return "gemm"


def _number(value):
  try:
    return float(value.replace(",", ""))
  except (AttributeError, ValueError):
    return None


# (column header, metric, scale) of the one-line-per-kernel table.
COMPACT = (("ms", "gpu__time_duration.sum", 1e-6),
           ("GHz", "sm__cycles_elapsed.avg.per_second", 1e-9),
           ("tensor%", "sm__pipe_tensor_cycles_active_realtime.avg.pct_of_peak_sustained_elapsed",
            1),
           ("DRAM rd GB", "dram__bytes_read.sum", 1e-9),
           ("DRAM wr GB", "dram__bytes_write.sum", 1e-9),
           ("L2>SM GB", "l1tex__m_xbar2l1tex_read_bytes.sum", 1e-9),
           ("inst M", "smsp__inst_executed.sum", 1e-6),
           ("smem wf M", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", 1e-6))


def summarize(paths, metrics=SUMMARY_METRICS):
  """Prints one line per profiled kernel (time, clock, DRAM and L2 bytes, instructions), then the
  counters of `metrics` side by side per role, one column per report (a role seen more than once
  in a report, e.g. SonicMoE's plain GEMMs, as role#i). Returns {role: {report: {metric: v}}}."""
  table = {}
  print(f"{'report':<44} {'kernel':<8}" + "".join(f"{h:>11}" for h, _, _ in COMPACT))
  for path in paths:
    label = re.sub(r"^ncu_|\.csv(\.gz)?$", "", os.path.basename(path))
    seen = {}
    for row in read_raw_csv(path):
      role = kernel_role(row["Kernel Name"])
      seen[role] = seen.get(role, 0) + 1
      role = role if seen[role] == 1 else f"{role}#{seen[role]}"
      values = {m: _number(row[m]) for m in set(metrics) | {m for _, m, _ in COMPACT} if m in row}
      table.setdefault(role, {})[label] = values
      cells = "".join(f"{values[m] * k:>11.3f}" if values.get(m) is not None else f"{'-':>11}"
                      for _, m, k in COMPACT)
      print(f"{label[:44]:<44} {role:<8}{cells}")
  for role, reports in table.items():
    labels = list(reports)
    print(f"\n{role}: " + " | ".join(labels))
    for m in metrics:
      vals = [reports[label].get(m) for label in labels]
      if all(v is None for v in vals):
        continue
      cells = " ".join(f"{v:>16.6g}" if v is not None else f"{'-':>16}" for v in vals)
      print(f"  {m:<62} {cells}")
  return table


def read_source_csv(path):
  """{kernel name: [{column: value}] per SASS instruction} of `ncu --import R --csv --page source
  --print-source sass` (each kernel a "Kernel Name" line, a header row, one row per instruction;
  a name seen again, e.g. SonicMoE's plain GEMMs, as name#i)."""
  with _open_csv(path) as f:
    kernels, name, header = {}, None, None
    for row in csv.reader(f):
      if row and row[0] == "Kernel Name":
        name, header, i = row[1], None, 1
        while name in kernels:
          i += 1
          name = f"{row[1]}#{i}"
        kernels[name] = []
      elif row and row[0] == "Address":
        header = row
      elif row and header is not None and name is not None:
        kernels[name].append(dict(zip(header, row)))
  return kernels


_SAMPLES = "Warp Stall Sampling (All Samples)"


def summarize_stalls(paths, top=12):
  """Where each kernel's warps were sampled stalled: the share of samples per opcode, then the
  `top` instructions with their main stall reasons (a barrier try-wait loop shows as the branch
  after SYNCS...TRYWAIT, stalled on the long scoreboard). Returns {report: {kernel: {opcode:
  share}}}."""
  out = {}
  for path in paths:
    label = re.sub(r"^ncu_|_sass\.csv(\.gz)?$", "", os.path.basename(path))
    for name, rows in read_source_csv(path).items():
      counts = [int(_number(r.get(_SAMPLES, "0")) or 0) for r in rows]
      total = sum(counts) or 1
      by_op = {}
      for r, n in zip(rows, counts):
        words = r.get("Source", "").split()
        words = words[1:] if words and words[0].startswith("@") else words
        op = words[0].split(".")[0] if words else "?"
        by_op[op] = by_op.get(op, 0) + n / total
      out.setdefault(label, {})[name] = by_op
      print(f"\n{label}: {name[:60]} ({total} samples)")
      print("  " + ", ".join(f"{op} {share:.1%}" for op, share in
                             sorted(by_op.items(), key=lambda kv: -kv[1])[:10]))
      reasons = [h for h in (rows[0] if rows else {}) if h.startswith("stall_") and "(" not in h]
      for r, n in sorted(zip(rows, counts), key=lambda rn: -rn[1])[:top]:
        why = sorted(((int(_number(r[h]) or 0), h[6:]) for h in reasons), reverse=True)[:3]
        print(f"  {n / total:6.1%} {r.get('Instructions Executed', ''):>10} "
              f"{r.get('Source', '').strip()[:56]:<56} "
              + " ".join(f"{h} {v}" for v, h in why if v))
  return out


def main():
  if len(sys.argv) > 1 and sys.argv[1] == "--summarize":
    summarize(sys.argv[2:])
    return
  if len(sys.argv) > 1 and sys.argv[1] == "--stalls":
    summarize_stalls(sys.argv[2:])
    return
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--impl", choices=["sonic_jax", "sonicmoe"], required=True)
  parser.add_argument("--thiek", required=True, help="configuration T,d,n,E,K")
  parser.add_argument("--calls", type=int, default=3,
                      help="forward calls, each synchronised; the last one is profiled")
  parser.add_argument("--layout", default="concat", choices=["concat", "interleaved"],
                      help="sonic_jax's gate/up layout (SonicMoE's is interleaved pairs)")
  parser.add_argument("--tuning", help="sonic_jax's tuning table (default: the packaged one)")
  parser.add_argument("--token_rounding", choices=["down", "up", "nearest"],
                      help="sonic_jax's token-rounding mode (default: plain top-K)")
  parser.add_argument("--step", action=argparse.BooleanOptionalAction, default=False,
                      help="the training step (forward and backward from a fixed dO) instead")
  args = parser.parse_args()
  cfg = tuple(int(v) for v in args.thiek.split(","))
  if len(cfg) != 5:
    parser.error(f"--thiek must be T,d,n,E,K, got {args.thiek!r}")
  if args.impl == "sonicmoe" and args.token_rounding:
    parser.error("--token_rounding is sonic_jax's (--impl=sonic_jax)")
  call = layer_call(args.impl, cfg, args.layout, args.step, args.tuning, args.token_rounding)
  for _ in range(args.calls - 1):
    call()
  profiled(call, args.impl)


if __name__ == "__main__":
  main()
