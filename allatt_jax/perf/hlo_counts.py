"""What a compiled step executes, counted from its optimized HLO: flops (of which
matmul flops), transcendentals and bytes accessed, each loop body counted as many
times as the loop runs (XLA's `cost_analysis()` counts a body once).

Per executed instruction, as XLA counts: a dot's flops are 2 · output elements ·
contracted size (library matmuls too); elementwise ops one per output element; a
reduction's combiner once per reduced element. Transcendentals: one per output
element of exp, log, tanh, sqrt, power, .... Bytes: operands read plus output written
by each top-level instruction (a fusion is one); slices and gathers read what they
output, a dynamic-update-slice writes its update; parameters, constants, tuples and
bitcasts move nothing. A matmul reads and writes the dtypes the program gives it
(XLA:CPU's widening/narrowing conversions around it are folded back in).

A while loop counts its body `known_trip_count` times (else once, listed in
`Analysis.unknown_trip_counts`); a conditional its cheapest branch (`Analysis.costliest`:
its dearest); ops whose flops are not modelled add bytes only (`Analysis.unmodelled`).
Counts are kept by scope (scopes.py) and model part. Bytes are XLA:CPU's fusion plan,
a proxy, not an accelerator's.
"""
import collections
import dataclasses
import math
import re

from allatt_jax.perf import hlo_text
from allatt_jax.perf import scopes

_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                   "after-all", "add-dependency", "opt-barrier", "partition-id",
                   "replica-id", "domain"})
_TRANSCENDENTAL = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "power",
    "sqrt", "cbrt", "rsqrt", "tanh", "sine", "cosine", "tan", "atan2", "erf"})
_ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum", "and",
    "or", "xor", "not", "negate", "abs", "sign", "compare", "select", "clamp", "convert",
    "shift-left", "shift-right-logical", "shift-right-arithmetic", "floor", "ceil",
    "round-nearest-afz", "round-nearest-even", "is-finite", "popcnt",
    "count-leading-zeros", "real", "imag", "complex", "reduce-precision",
    "stochastic-convert", "bitcast-convert"}) | _TRANSCENDENTAL
# Ops that do work this walk does not count as flops (their bytes still count).
_UNMODELLED = frozenset({"custom-call", "convolution", "fft", "sort", "triangular-solve",
                         "cholesky", "rng", "rng-bit-generator",
                         "select-and-scatter", "all-reduce", "reduce-scatter",
                         "async-start", "top-k"})
_TOP = 12   # scopes listed by the proxy
# Options of a compile whose HLO the walk reads as an accelerator's: XLA:CPU would
# otherwise drop a bf16 program's roundings between float32 ops ("excess precision")
# and keep float32 arrays where an accelerator keeps bf16 ones.
COMPILER_OPTIONS = {"xla_allow_excess_precision": False}
# Instructions through which a fusion parameter is read only in part.
_SLICING = frozenset({"slice", "dynamic-slice", "gather"})


@dataclasses.dataclass(frozen=True)
class Cost:
  """Counts of one execution of a computation (or of a whole step)."""
  flops: float = 0.0              # all flops, matmul flops included
  matmul_flops: float = 0.0
  transcendentals: float = 0.0
  bytes_accessed: float = 0.0

  def __add__(self, other: "Cost") -> "Cost":
    return Cost(self.flops + other.flops, self.matmul_flops + other.matmul_flops,
                self.transcendentals + other.transcendentals,
                self.bytes_accessed + other.bytes_accessed)

  def __mul__(self, times: float) -> "Cost":
    return Cost(self.flops * times, self.matmul_flops * times,
                self.transcendentals * times, self.bytes_accessed * times)


@dataclasses.dataclass(frozen=True)
class Analysis:
  """A module's counts (see the module docstring for what is counted how)."""
  cost: Cost                      # cheapest branch of every conditional
  costliest: Cost                 # most expensive branch of every conditional
  by_scope: dict[str, Cost]       # `cost` by folded scope (scopes.of_instructions)
  loops: int                      # while instructions walked
  conditionals: int               # conditional instructions walked
  unknown_trip_counts: tuple[str, ...]   # loops counted once: no known trip count
  unmodelled: dict[str, int]      # opcode -> instructions whose flops are not counted

  @property
  def parts(self) -> dict[str, Cost]:
    """`cost` by model part: scopes.PARTS' and scopes.REST."""
    return _combined(({scopes.part(s): cost}, 1) for s, cost in self.by_scope.items())


def _total(by_scope: dict[str, Cost]) -> Cost:
  return sum(by_scope.values(), Cost())


def _combined(terms) -> dict[str, Cost]:
  """The sum of (counts by scope) x times over `terms`, pairs of them."""
  combined = {}
  for by_scope, times in terms:
    for scope, cost in by_scope.items():
      combined[scope] = combined.get(scope, Cost()) + cost * times
  return combined


class _Walk:
  """Counts executed computations by scope, memoised by computation, picking
  conditional branches with `pick` (min or max)."""

  def __init__(self, module: hlo_text.Module, pick):
    self.module, self.pick = module, pick
    self.scopes = {name: scope for name, (scope, _) in scopes.of_instructions(module).items()}
    self.loops, self.conditionals = set(), set()
    self.unknown_trip_counts, self.unmodelled = set(), collections.Counter()
    self._executed, self._fused = {}, {}

  def executed(self, name: str) -> dict[str, Cost]:
    """One execution of a computation whose instructions run one by one."""
    if name not in self._executed:
      computation = self.module.computations[name]
      folded, moved = _matmul_conversions(self.module, computation)
      self._executed[name] = _combined(
          (self._top_level(computation, i) if i.name not in folded else {}, 1)
          for i in computation.instructions.values())
      self._executed[name] = _combined([(self._executed[name], 1), (
          {self.scopes[n]: Cost(bytes_accessed=b) for n, b in moved.items()}, 1)])
    return self._executed[name]

  def fused(self, name: str) -> Cost:
    """Flops of one execution of a fused (or combiner) computation: no bytes."""
    if name not in self._fused:
      computation = self.module.computations[name]
      total = Cost()
      for instruction in computation.instructions.values():
        total += self._flops(computation, instruction)
      self._fused[name] = total
    return self._fused[name]

  def _flops(self, computation: hlo_text.Computation,
             instruction: hlo_text.Instruction) -> Cost:
    op = instruction.opcode
    gemm_dims = instruction.gemm_contracting_dims if op == "custom-call" else None
    if op == "dot" or gemm_dims is not None:
      lhs = computation.instructions[instruction.operands[0]].arrays[0]
      dims = instruction.dims("lhs_contracting_dims") if op == "dot" else gemm_dims
      flops = 2.0 * instruction.elements * math.prod(lhs.dims[d] for d in dims)
      return Cost(flops=flops, matmul_flops=flops)
    if op in _TRANSCENDENTAL:
      return Cost(transcendentals=instruction.elements)
    if op in _ELEMENTWISE:
      return Cost(flops=instruction.elements)
    if op == "fusion":
      return self.fused(instruction.called[0])
    if op == "reduce":
      reduced = computation.instructions[instruction.operands[0]].elements
      return self.fused(instruction.called[0]) * (reduced - instruction.elements)
    if op == "reduce-window":
      size = re.search(r"size=([\dx]+)", instruction.attribute("window") or "")
      window = math.prod(int(n) for n in size.group(1).split("x")) if size else 1
      return self.fused(instruction.called[0]) * (instruction.elements * (window - 1))
    if op == "scatter":
      updates = computation.instructions[instruction.operands[-1]].elements
      return self.fused(instruction.called[0]) * updates
    if op == "map":
      return self.fused(instruction.called[0]) * instruction.elements
    if op in _UNMODELLED:
      self.unmodelled[op] += 1
    return Cost()

  def _top_level(self, computation: hlo_text.Computation,
                 instruction: hlo_text.Instruction) -> dict[str, Cost]:
    op = instruction.opcode
    if op in _FREE:
      return {}
    if op == "while":
      self.loops.add(instruction.name)
      condition, body = (instruction.attribute(k).lstrip("%") for k in ("condition", "body"))
      trips = instruction.trip_count
      if trips is None:
        self.unknown_trip_counts.add(instruction.name)
        trips = 1
      return _combined([(self.executed(body), trips),
                        (self.executed(condition), trips + 1)])
    if op == "call":
      return self.executed(instruction.called[0])
    if op == "conditional":
      self.conditionals.add(instruction.name)
      return self.pick((self.executed(b) for b in instruction.branches),
                       key=lambda by_scope: (_total(by_scope).flops,
                                             _total(by_scope).bytes_accessed))
    operand = lambda i: computation.instructions[instruction.operands[i]]
    operands_bytes = lambda first: sum(operand(i).bytes
                                       for i in range(first, len(instruction.operands)))
    if op in ("slice", "dynamic-slice"):
      moved = 2 * instruction.bytes + operands_bytes(1)
    elif op == "gather":
      # Not the whole table, as XLA counts (an embedding lookup would read it all).
      moved = 2 * instruction.bytes + operand(1).bytes
    elif op == "dynamic-update-slice":
      moved = 2 * operand(1).bytes + operands_bytes(2)
    elif op == "scatter":
      updates = operand(len(instruction.operands) - 1).bytes
      moved = 3 * updates + operand(1).bytes
    elif op == "fusion":
      moved = self._fusion_bytes(computation, instruction)
    else:
      moved = operands_bytes(0) + instruction.bytes
    return {self.scopes[instruction.name]:
            self._flops(computation, instruction) + Cost(bytes_accessed=moved)}

  def _fusion_bytes(self, computation: hlo_text.Computation,
                    fusion: hlo_text.Instruction) -> float:
    body = self.module.computations[fusion.called[0]]
    root = body.instructions[body.root]
    outputs = ([body.instructions[n] for n in root.operands] if root.opcode == "tuple"
               else [root])
    written = sum(body.instructions[o.operands[1]].bytes
                  if o.opcode == "dynamic-update-slice" else o.bytes for o in outputs)
    read = 0
    for parameter in body.instructions.values():
      if parameter.opcode != "parameter":
        continue
      argument_bytes = computation.instructions[
          fusion.operands[int(parameter.operands[0])]].bytes
      read += _parameter_read(body, parameter, argument_bytes)
    return written + read


def _float_bits(instruction: hlo_text.Instruction) -> int | None:
  arrays = instruction.arrays
  if len(arrays) != 1 or not arrays[0].dtype.startswith(("f", "bf")):
    return None
  return arrays[0].bytes * 8 // max(arrays[0].elements, 1)


def _is_conversion(module: hlo_text.Module, instruction: hlo_text.Instruction) -> bool:
  """A float conversion alone: a convert, or a fusion of one with bitcasts only."""
  if instruction.opcode == "convert":
    return True
  if instruction.opcode != "fusion" or len(instruction.operands) != 1:
    return False
  ops = [i.opcode for i in module.computations[instruction.called[0]].instructions.values()]
  return ops.count("convert") == 1 and set(ops) <= {"parameter", "convert", "bitcast"}


def _is_matmul(module: hlo_text.Module, instruction: hlo_text.Instruction) -> bool:
  """A dot, a library matmul, or a fusion around a dot (XLA:CPU's matmul fusions)."""
  if instruction.opcode == "dot" or (instruction.opcode == "custom-call"
                                     and instruction.gemm_contracting_dims is not None):
    return True
  return instruction.opcode == "fusion" and any(
      i.opcode == "dot" for i in module.computations[instruction.called[0]].instructions.values())


def _narrow_read(module: hlo_text.Module, source: hlo_text.Instruction,
                 user: hlo_text.Instruction) -> tuple[str, int] | None:
  """(dtype, bits) of the narrower float `user` reads a matmul's result `source` as,
  when it reads it only through a conversion to it (alone, or inside a fusion)."""
  source_bits = _float_bits(source)
  if _is_conversion(module, user):
    bits = _float_bits(user)
    return (user.arrays[0].dtype, bits) if bits and bits < source_bits else None
  if user.opcode != "fusion":
    return None
  body = module.computations[user.called[0]]
  reads = set()
  for parameter in body.instructions.values():
    if (parameter.opcode != "parameter"
        or user.operands[int(parameter.operands[0])] != source.name):
      continue
    pending = [parameter.name]
    while pending:
      for inner in body.users(pending.pop()):
        if inner.opcode == "bitcast":
          pending.append(inner.name)
        elif inner.opcode == "convert" and (_float_bits(inner) or 64) < source_bits:
          reads.add((inner.arrays[0].dtype, _float_bits(inner)))
        else:
          return None
  return reads.pop() if len(reads) == 1 else None


def _matmul_conversions(module: hlo_text.Module, computation: hlo_text.Computation
                        ) -> tuple[set[str], dict[str, int]]:
  """(conversions folded into the matmuls they serve, bytes each instruction moves
  less): a widening conversion read only by matmuls, which then read the narrow
  operand; and a matmul's result read only through conversions to one narrower
  float, which the matmul then writes narrow (a conversion alone is folded, a fusion
  around one reads the narrow result)."""
  folded, moved = set(), collections.Counter()
  for instruction in computation.instructions.values():
    if _is_conversion(module, instruction):
      source = computation.instructions[instruction.operands[0]]
      bits, source_bits = _float_bits(instruction), _float_bits(source)
      users = computation.users(instruction.name)
      if (bits and source_bits and bits > source_bits and users
          and all(_is_matmul(module, u) for u in users)):
        folded.add(instruction.name)
        for user in users:
          moved[user.name] -= instruction.bytes - source.bytes
    if not (_is_matmul(module, instruction) and _float_bits(instruction)):
      continue
    users = computation.users(instruction.name)
    reads = {_narrow_read(module, instruction, user) for user in users}
    if not users or len(reads) != 1 or None in reads:
      continue
    (_, bits), = reads
    saved = instruction.bytes - instruction.elements * bits // 8
    moved[instruction.name] -= saved
    for user in users:
      if _is_conversion(module, user):
        folded.add(user.name)
      else:
        moved[user.name] -= saved
  return folded, moved


def _parameter_read(body: hlo_text.Computation, parameter: hlo_text.Instruction,
                    whole: int) -> int:
  """Bytes a fusion reads of one parameter: what its slicing users take, plus the
  whole argument once if anything else reads it (bitcasts looked through)."""
  sliced, read_whole = 0, False
  pending = [parameter.name]
  while pending:
    name = pending.pop()
    for user in body.users(name):
      first = user.operands[0] == name
      if user.opcode == "bitcast":
        pending.append(user.name)
      elif user.opcode in _SLICING and (first or user.opcode == "slice"):
        sliced += user.bytes
      elif user.opcode == "dynamic-update-slice" and first:
        continue   # updated in place: the fusion's output aliases it
      else:
        read_whole = True
  return sliced + (whole if read_whole else 0)


def analyse(hlo) -> Analysis:
  """The counts of a compiled step's optimized HLO (`compiled.as_text()`, or its
  parsed `hlo_text.Module`)."""
  module = hlo if isinstance(hlo, hlo_text.Module) else hlo_text.parse(hlo)
  cheapest = _Walk(module, min)
  by_scope = cheapest.executed(module.entry)
  cost = _total(by_scope)
  costliest = (_total(_Walk(module, max).executed(module.entry)) if cheapest.conditionals
               else cost)
  return Analysis(cost=cost, costliest=costliest, by_scope=by_scope,
                  loops=len(cheapest.loops),
                  conditionals=len(cheapest.conditionals),
                  unknown_trip_counts=tuple(sorted(cheapest.unknown_trip_counts)),
                  unmodelled=dict(sorted(cheapest.unmodelled.items())))


def _per_token(cost: Cost, tokens: int) -> dict:
  return {"flops": cost.flops / tokens, "matmul_flops": cost.matmul_flops / tokens,
          "other_flops": (cost.flops - cost.matmul_flops) / tokens,
          "transcendentals": cost.transcendentals / tokens,
          "bytes": cost.bytes_accessed / tokens}


def step_proxy(compiled, tokens: int) -> dict:
  """The proxy figures of a compiled step (`jax.stages.Compiled`) that processes
  `tokens` tokens: per token, flops (matmul and other), transcendentals and bytes
  accessed, loops counted by their trip counts, in all, by model part (the output
  layer, the attention, the rest: scopes.py) and for the scopes that access the most
  bytes; XLA's own per-token figures (loop bodies counted once) for comparison; and
  what the walk could not count."""
  analysis = analyse(compiled.as_text())
  parts = analysis.parts
  xla = compiled.cost_analysis()
  xla = (xla[0] if isinstance(xla, (list, tuple)) else xla) or {}
  proxy = {"tokens": tokens, **_per_token(analysis.cost, tokens),
           "parts": {part: _per_token(parts.get(part, Cost()), tokens)
                     for part in (*scopes.PARTS, scopes.REST)},
           "top_scopes_by_bytes": [
               {"name": name, **_per_token(cost, tokens)} for name, cost in sorted(
                   analysis.by_scope.items(), key=lambda kv: -kv[1].bytes_accessed)[:_TOP]],
           "xla_loops_once": {"flops": xla.get("flops", 0.0) / tokens,
                              "bytes": xla.get("bytes accessed", 0.0) / tokens},
           "loops": analysis.loops, "conditionals": analysis.conditionals,
           "unknown_trip_counts": list(analysis.unknown_trip_counts),
           "unmodelled": analysis.unmodelled}
  if analysis.costliest != analysis.cost:
    proxy["costliest_branches"] = _per_token(analysis.costliest, tokens)
  return proxy
