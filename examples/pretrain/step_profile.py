"""Where a training step's device time goes: MoE layers, attention, other layers, collectives and
the optimizer.

The model names its parts with `jax.named_scope` ("attention", "moe"; the train step's
"optimizer"), which XLA keeps in each instruction's `op_name` metadata. A profiler trace of one
step gives every kernel with the instruction it runs (its `hlo_op`); the compiled step's HLO text
maps that instruction to its `op_name`, hence to a part. On a GPU the traced step is compiled with
`COMPILER_OPTIONS` (no CUDA graphs), so every kernel names its own instruction. Collectives (NCCL
kernels, or XLA's collective instructions) are one part whatever scope issued them; each block's two
norms run inside its "attention" and "moe" scopes and count there (as does the attention's residual
add). "other layers" is everything else: the MoE's residual add, the embedding, the final norm, the
output projection and the loss, gradient accumulation and the gradient's norm, the selection-bias
update. `split` lists the costliest of those.
On a CPU the XLA thunks of one device run on several threads, so their sum exceeds the step's span
with or without collectives beside them.
"""

from __future__ import annotations

import collections
import glob
import os
import re

import jax

PARTS = ("moe", "attention", "other layers", "collectives", "optimizer")
_SCOPES = ("optimizer", "moe", "attention")  # first match wins: the optimizer's update of MoE
# weights is optimizer time
_COLLECTIVE = re.compile(r"(all-gather|all-reduce|reduce-scatter|all-to-all|ragged-all-to-all|"
                         r"collective-permute|send|recv)\b")
# The profiled step is compiled without CUDA graphs on a GPU: a kernel launched from a command
# buffer is traced with the buffer as its instruction, which names no scope.
COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": ""}


def compiler_options(backend: str) -> dict[str, str]:
  """The profiled step's compiler options on `backend`: `COMPILER_OPTIONS` on a GPU; none
  elsewhere, where the option means nothing and the step is the training step's own program (a
  compilation-cache hit rather than a second compile)."""
  return COMPILER_OPTIONS if backend == "gpu" else {}
TOP_OTHER = 12  # the costliest "other layers" kernels a split lists, to show what they are
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=.*?op_name="([^"]*)"')


def op_names(hlo_text: str) -> dict[str, str]:
  """{instruction name: its op_name metadata} of a compiled module's HLO text."""
  out = {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if m:
      out[m.group(1)] = m.group(2)
  return out


def part_of(hlo_op: str | None, kernel: str, names: dict[str, str]) -> str:
  if "nccl" in kernel.lower() or (hlo_op and _COLLECTIVE.match(hlo_op)):
    return "collectives"
  op_name = names.get(hlo_op or "", "")
  for scope in _SCOPES:  # a path segment, or wrapped as in "jvp(moe)"
    if re.search(rf"(^|[/(]){scope}([/)]|$)", op_name):
      return scope
  return "other layers"


def kernel_events(logdir: str, module: str):
  """[(start_ns, duration_ns, kernel name, hlo_op)] of the first GPU's kernels of the XLA module
  whose name contains `module` (without a GPU: the first CPU device's XLA thunks of it, which run
  on several threads at once), in start order, from the newest trace under `logdir` (each trace
  adds a directory of its own there)."""
  paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
  if not paths:
    return []
  profile = jax.profiler.ProfileData.from_file(max(paths, key=os.path.getmtime))
  planes = list(profile.planes)  # an iterator
  gpus = [p for p in planes if re.match(r"/device:GPU:0\b", p.name)]
  events = []
  for plane in gpus or [p for p in planes if p.name == "/host:CPU"]:
    for line in plane.lines:
      if gpus and "stream" not in line.name.lower():
        continue
      for ev in line.events:
        stats = dict(ev.stats)
        if not gpus and stats.get("device_ordinal", 0) != 0:
          continue  # the host plane holds every CPU device's thunks: keep device 0's
        if module in str(stats.get("hlo_module", "")):
          events.append((ev.start_ns, ev.duration_ns, ev.name, stats.get("hlo_op")))
  return sorted(events)


def split(events, names: dict[str, str]) -> dict:
  """Milliseconds of kernel time per part (and kernels per part), the kernels' sum and the step's
  span (first start to last end; collectives overlap computation where the sum exceeds the span),
  and the costliest "other layers" kernels by name and op_name."""
  ms, count = collections.defaultdict(float), collections.Counter()
  other = collections.defaultdict(float)
  for _, duration, kernel, hlo_op in events:
    part = part_of(hlo_op, kernel, names)
    ms[part] += duration / 1e6
    count[part] += 1
    if part == "other layers":
      other[(kernel[:80], names.get(hlo_op or "", f"hlo_op {hlo_op}")[-160:])] += duration / 1e6
  span = (max(s + d for s, d, *_ in events) - events[0][0]) / 1e6 if events else 0.0
  top = sorted(other.items(), key=lambda kv: -kv[1])[:TOP_OTHER]
  return {"parts_ms": {p: ms[p] for p in PARTS}, "kernels": {p: count[p] for p in PARTS},
          "kernel_sum_ms": sum(ms.values()), "span_ms": span,
          "top_other": [[k, op, round(t, 3)] for (k, op), t in top]}


def table(result: dict) -> str:
  total = result["kernel_sum_ms"] or 1.0
  lines = ["| part | ms | share of kernel time | kernels |", "|---|---|---|---|"]
  for p in PARTS:
    lines.append(f"| {p} | {result['parts_ms'][p]:.2f} | {100 * result['parts_ms'][p] / total:.0f}%"
                 f" | {result['kernels'][p]} |")
  lines.append(f"| kernel time / step span | {result['kernel_sum_ms']:.2f} / "
               f"{result['span_ms']:.2f} | | |")
  return "\n".join(lines)
