"""Where a compiled step spends its time: a `jax.profiler` trace of a few steps, each
kernel attributed to the JAX scope that produced it (scopes.py).

GPU: device kernel times, kernels the HLO does not name kept as 'unattributed'. CPU:
host thunks' self times summed over threads, close to, not equal to, wall time. A
trace that names no HLO instruction gives `attributed: False`, not invented figures.
"""
import collections
import dataclasses
import glob
import os
import re
import tempfile
import time

import jax

from allatt_jax.perf import hlo_text
from allatt_jax.perf import scopes

_MATMUL_NAME = re.compile(r"gemm|matmul|cublas|cutlass|xmma|\bdot", re.IGNORECASE)
_TOP = 15   # scopes and kernels listed
# A device plane's lines that summarise its kernels (modules, steps, framework ops).
_DERIVED_LINES = frozenset({"XLA Modules", "Steps", "Framework Ops", "TensorFlow Ops",
                            "Framework Name Scope", "Launch Stats", "Source code",
                            "XLA TraceMe", "TensorFlow Name Scope"})


_HOST_NOTE = ("XLA:CPU thunks on the host threads that ran them, each event less the "
              "events nested in it (a loop's body), summed over threads: not the "
              "step's wall time, and a dot's work on Eigen's other threads counts on "
              "the thread that launched it.")


@dataclasses.dataclass(frozen=True)
class Op:
  """What a kernel of an HLO instruction counts as."""
  kind: str        # 'matmul', 'fusion' (a non-matmul fusion), or 'other'
  scope: str       # folded scope (scopes.fold)
  inferred: bool   # the scope is a neighbour's: XLA left the instruction unnamed


def _matmul(instruction: hlo_text.Instruction) -> bool:
  if instruction.opcode in ("dot", "convolution"):
    return True
  target = instruction.attribute("custom_call_target") or ""
  return instruction.opcode == "custom-call" and bool(_MATMUL_NAME.search(target))


def hlo_ops(module: hlo_text.Module) -> dict[str, Op]:
  """The kind and scope (scopes.of_instructions) of every instruction of the module,
  by name."""
  matmul_in = {}   # computation -> whether a matmul runs in it (nested fusions too)

  def has_matmul(computation: str) -> bool:
    if computation not in matmul_in:
      matmul_in[computation] = any(
          _matmul(i) or (i.opcode == "fusion" and has_matmul(i.called[0]))
          for i in module.computations[computation].instructions.values())
    return matmul_in[computation]

  named = scopes.of_instructions(module)
  ops = {}
  for computation in module.computations.values():
    for name, instruction in computation.instructions.items():
      if instruction.opcode == "fusion":
        kind = "matmul" if has_matmul(instruction.called[0]) else "fusion"
      else:
        kind = "matmul" if _matmul(instruction) else "other"
      ops[name] = Op(kind, *named[name])
  return ops


def _self_times(events) -> list[tuple[object, float]]:
  """(event, its duration less that of the events nested in it) of one line's events."""
  events = sorted(events, key=lambda e: (e.start_ns, -e.duration_ns))
  own = [e.duration_ns for e in events]
  open_events = []   # indices of events that contain the current one, innermost last
  for i, event in enumerate(events):
    while open_events and (events[open_events[-1]].start_ns
                           + events[open_events[-1]].duration_ns <= event.start_ns):
      open_events.pop()
    if open_events:
      own[open_events[-1]] -= event.duration_ns
    open_events.append(i)
  return list(zip(events, own))


def _event_lines(profile):
  """(the plane's name, its lines whose events are kernels, whether every event of
  them counts or only those naming an HLO instruction)."""
  planes = {plane.name: plane for plane in profile.planes}
  devices = sorted(n for n in planes if n.startswith("/device:") and "CUSTOM" not in n)
  for name in devices:
    lines = {line.name: line for line in planes[name].lines}
    if not lines:
      continue
    chosen = ([lines["XLA Ops"]] if "XLA Ops" in lines
              else [l for n, l in lines.items() if n.startswith("Stream")]
              or [l for n, l in lines.items() if n not in _DERIVED_LINES])
    return name, chosen, True
  host = planes.get("/host:CPU")
  return "/host:CPU", list(host.lines) if host else [], False


def breakdown(profile, hlo: str, steps: int) -> dict:
  """The per-scope breakdown of `steps` steps of the compiled step whose optimized HLO
  is `hlo`, from a trace of them (a `jax.profiler.ProfileData`); times per step."""
  module = hlo_text.parse(hlo)
  ops = hlo_ops(module)
  normalised = {re.sub(r"[.\-]", "_", n): op for n, op in ops.items()}
  plane, lines, all_events = _event_lines(profile)
  by_scope, by_kind, by_kernel = (collections.Counter() for _ in range(3))
  unattributed = inferred = 0.0
  for line in lines:
    for event, ns in _self_times(line.events):
      stats = dict(event.stats)
      module_name = str(stats.get("hlo_module") or module.name)
      if module_name.split("(")[0] != module.name:
        continue   # another program's kernel
      name = str(stats.get("hlo_op") or event.name)
      if not all_events and "hlo_op" not in stats:
        continue   # host events of the runtime and of Python, not of the step
      op = ops.get(name) or normalised.get(re.sub(r"[.\-]", "_", name))
      if op is None:
        unattributed += ns
        kind = ("matmul" if _MATMUL_NAME.search(name)
                else "fusion" if "fusion" in name else "other")
        op = Op(kind, "(unattributed)", False)
      inferred += ns if op.inferred else 0.0
      ms = ns / 1e6 / steps
      by_scope[op.scope] += ms
      by_kind[op.kind] += ms
      by_kernel[name] += ms
  total = sum(by_kind.values())
  report = {"plane": plane, "steps": steps, "kernel_ms_per_step": total,
            "lines": sorted({line.name for line in lines}) if all_events else []}
  if not total or unattributed / 1e6 / steps > 0.5 * total:
    return {**report, "attributed": False,
            "note": f"The trace's {plane} events name no HLO instruction of "
            f"{module.name} for most of the time: it does not attribute time "
            "per op on this platform."}
  by_part = collections.defaultdict(collections.Counter)   # part -> direction -> ms
  for scope, ms in by_scope.items():
    by_part[scopes.part(scope)][scope.partition(" ")[0]] += ms
  return {
      **report, "attributed": True, "note": _HOST_NOTE if not all_events else
      f"Kernel time on {plane}, from its {', '.join(report['lines'])} line(s).",
      "unattributed_ms_per_step": unattributed / 1e6 / steps,
      "inferred_scope_ms_per_step": inferred / 1e6 / steps,
      "kinds_ms_per_step": {k: by_kind.get(k, 0.0) for k in ("matmul", "fusion", "other")},
      "parts": {part: {"ms_per_step": sum(by_part[part].values()),
                       "share": sum(by_part[part].values()) / total,
                       **{f"{d}_ms": ms for d, ms in sorted(by_part[part].items())}}
                for part in (*scopes.PARTS, scopes.REST)},
      "top_scopes": _top(by_scope, total), "top_kernels": _top(by_kernel, total)}


def _top(counter, total) -> list[dict]:
  return [{"name": name, "ms_per_step": ms, "share": ms / total}
          for name, ms in counter.most_common(_TOP)]


def trace(run, steps: int):
  """The `jax.profiler.ProfileData` of `run(steps)` (which must block until done),
  and the wall seconds it took."""
  with tempfile.TemporaryDirectory() as folder:
    jax.profiler.start_trace(folder)
    start = time.perf_counter()
    try:
      run(steps)
    finally:
      wall = time.perf_counter() - start
      jax.profiler.stop_trace()
    path, = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    return jax.profiler.ProfileData.from_file(path), wall


def profile(run, hlo: str, steps: int) -> dict:
  """`breakdown` of a trace of `run(steps)`, with the traced steps' wall time."""
  data, wall = trace(run, steps)
  return {**breakdown(data, hlo, steps), "traced_step_s": wall / steps,
          "platform": jax.default_backend()}


def summary(report: dict) -> list[str]:
  """A few lines of a `profile` report."""
  if not report["attributed"]:
    return [f"profile: {report['note']}"]
  kinds = report["kinds_ms_per_step"]
  total = report["kernel_ms_per_step"]
  lines = [f"profile ({report['platform']}, {report['plane']}): {total:.1f} ms of kernels "
           f"per step (traced step {1e3 * report['traced_step_s']:.1f} ms): matmul "
           f"{kinds['matmul'] / total:.0%}, other fusions {kinds['fusion'] / total:.0%}, "
           f"copies and other {kinds['other'] / total:.0%}; scope inferred for "
           f"{report['inferred_scope_ms_per_step'] / total:.0%}"]
  for part in scopes.PARTS:
    p = report["parts"][part]
    lines.append(f"  {part.replace('_', ' ')} {p['ms_per_step']:.1f} ms ({p['share']:.0%}: "
                 f"forward {p.get('forward_ms', 0):.1f}, backward "
                 f"{p.get('backward_ms', 0):.1f})")
  for scope in report["top_scopes"][:8]:
    lines.append(f"  {scope['ms_per_step']:8.2f} ms {scope['share']:4.0%}  {scope['name']}")
  return lines
