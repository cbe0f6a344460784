"""The optimized HLO of a compiled step (`compiled.as_text()`), read into computations
and instructions.

Parsed: each instruction's name, shape, opcode, operands and the attributes the cost
walk and the profile read (called computations, dot dimensions, a while loop's trip
count, op_name). The format is XLA's printer's on every backend; '%' is optional.
"""
import dataclasses
import functools
import math
import re

# Bytes per element of XLA's element types (pred is stored as a byte).
_DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
    "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([^\]]*)\]")
_INSTRUCTION = re.compile(r"\s*(ROOT\s+)?%?([\w.\-]+) = (.*)$")
_COMPUTATION = re.compile(r"(ENTRY\s+)?%?([\w.\-]+) .*\{$")
_COMMENT = re.compile(r"/\*.*?\*/")   # the printer's /*index=5*/ in long lists


@dataclasses.dataclass(frozen=True)
class Array:
  """One array of a shape: its element type and dimensions."""
  dtype: str
  dims: tuple[int, ...]

  @property
  def elements(self) -> int:
    return math.prod(self.dims)

  @property
  def bytes(self) -> int:
    if self.dtype[:2] in ("f8", "f6", "f4", "s2", "u2"):   # f8e4m3fn, ...: a byte each
      return self.elements
    return self.elements * _DTYPE_BYTES[self.dtype]


def arrays(shape: str) -> tuple[Array, ...]:
  """The arrays of a shape's text ('f32[8,16]{1,0}', or a tuple of them); a dynamic
  dimension ('<=10') counts at its bound."""
  return tuple(Array(dtype, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d))
               for dtype, dims in _ARRAY.findall(shape))


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  shape: str        # its text: 'f32[8,16]{1,0}' or '(s32[], f32[8,16]{1,0})'
  opcode: str
  operands: tuple[str, ...]
  attributes: str   # the text after the operand list

  @functools.cached_property
  def arrays(self) -> tuple[Array, ...]:
    return arrays(self.shape)

  @property
  def bytes(self) -> int:
    """The bytes of every array of its shape (a tuple's elements summed)."""
    return sum(a.bytes for a in self.arrays)

  @property
  def elements(self) -> int:
    """Elements of its (first) array."""
    return self.arrays[0].elements if self.arrays else 0

  def attribute(self, key: str) -> str | None:
    """The raw value of `key=...` (a name, or a '{...}' list), or None."""
    match = re.search(rf"(?:^|, ){key}=(\{{[^}}]*\}}|[^,\s]+)", self.attributes)
    return match.group(1) if match else None

  def dims(self, key: str) -> tuple[int, ...]:
    """An attribute that lists dimensions, e.g. lhs_contracting_dims={1,2}."""
    value = self.attribute(key) or "{}"
    return tuple(int(d) for d in value.strip("{}").split(",") if d.strip())

  @property
  def called(self) -> tuple[str, ...]:
    """Names of the computations it calls (a fusion's body, a loop's condition and
    body, a conditional's branches, a reduction's combiner)."""
    names = []
    for key in ("calls", "to_apply", "condition", "body", "branch_computations",
                "true_computation", "false_computation"):
      value = self.attribute(key)
      if value:
        names += [n.strip().lstrip("%") for n in value.strip("{}").split(",")]
    return tuple(names)

  @property
  def branches(self) -> tuple[str, ...]:
    """A conditional's branch computations, in branch order."""
    value = self.attribute("branch_computations")
    if value:
      return tuple(n.strip().lstrip("%") for n in value.strip("{}").split(","))
    return tuple(self.attribute(k).lstrip("%")
                 for k in ("true_computation", "false_computation"))

  @property
  def trip_count(self) -> int | None:
    """A while loop's trip count as XLA's optimizer knows it (its backend_config's
    known_trip_count), or None."""
    match = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', self.attributes)
    return int(match.group(1)) if match else None

  @property
  def gemm_contracting_dims(self) -> tuple[int, ...] | None:
    """The lhs contracting dimensions of a GPU library matmul (a custom call whose
    backend_config has dot dimension numbers), or None."""
    match = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', self.attributes)
    if not match:
      return None
    return tuple(int(d.strip().strip('"')) for d in match.group(1).split(",") if d.strip())

  @property
  def op_name(self) -> str:
    """The JAX scope its metadata names ('jit(f)/jvp(Model)/layer_0/dot_general'), or
    ''. XLA joins the names of merged instructions with ';': the first is kept."""
    match = re.search(r'op_name="([^"]*)"', self.attributes)
    return match.group(1).split(";")[0] if match else ""


@dataclasses.dataclass(frozen=True)
class Computation:
  name: str
  instructions: dict[str, Instruction]   # in the printed (scheduled) order
  root: str

  def users(self, name: str) -> list[Instruction]:
    return self._users.get(name, [])

  @functools.cached_property
  def _users(self) -> dict[str, list[Instruction]]:
    users = {}
    for instruction in self.instructions.values():
      for operand in dict.fromkeys(instruction.operands):
        users.setdefault(operand, []).append(instruction)
    return users


@dataclasses.dataclass(frozen=True)
class Module:
  name: str
  computations: dict[str, Computation]
  entry: str

  def op_name(self, instruction: Instruction) -> str:
    """The instruction's op_name; a fusion without one (XLA:CPU's custom fusions) takes
    its root's, or else the first one inside it."""
    if instruction.op_name or instruction.opcode != "fusion":
      return instruction.op_name
    body = self.computations[instruction.called[0]]
    return body.instructions[body.root].op_name or next(
        (i.op_name for i in body.instructions.values() if i.op_name), "")


def _closing(text: str, start: int) -> int:
  """The index of the parenthesis that closes the one at `start`."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i
  raise ValueError(f"unbalanced parentheses in HLO: {text[:200]}")


def _split_top_level(text: str) -> list[str]:
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(ch, 0)
    if ch == "," and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  return [p.strip() for p in parts + [text[start:]] if p.strip()]


def _instruction(name: str, text: str) -> Instruction:
  if text.startswith("("):
    end = _closing(text, 0) + 1
  else:
    end = text.index(" ")
  shape, rest = text[:end], text[end:].lstrip()
  open_at = rest.index("(")
  close_at = _closing(rest, open_at)
  operands = tuple(item.split()[-1].lstrip("%")
                   for item in _split_top_level(rest[open_at + 1:close_at]))
  return Instruction(name=name, shape=shape, opcode=rest[:open_at], operands=operands,
                     attributes=rest[close_at + 1:].lstrip(", "))


def parse(text: str) -> Module:
  """The module of `compiled.as_text()`.

  Raises:
    ValueError: the text has no entry computation (it is not an HLO module's).
  """
  module_name, computations, entry = "", {}, None
  current, instructions, root = None, {}, None
  for line in text.splitlines():
    if line.startswith("HloModule "):
      module_name = line.split()[1].rstrip(",")
    elif current is None:
      match = _COMPUTATION.match(line)
      if match and "->" in line:
        current, instructions, root = match.group(2), {}, None
        entry = current if match.group(1) else entry
    elif line.strip() == "}":
      computations[current] = Computation(current, instructions, root)
      current = None
    else:
      match = _INSTRUCTION.match(_COMMENT.sub("", line))
      if match:
        instruction = _instruction(match.group(2), match.group(3))
        instructions[instruction.name] = instruction
        root = instruction.name if match.group(1) else root
  if entry is None:
    raise ValueError("No ENTRY computation in the HLO text.")
  return Module(module_name, computations, entry)
