"""The JAX scopes of a train step's HLO instructions (their metadata's op_name), folded
into the names and model parts that the profile (step_profile.py) and the cost walk
(hlo_counts.py) report.

An op_name reads e.g. `jit(train_step)/transpose(jvp(TransformerLM))/
TransformerLM.hidden/layer_3/attention/while/body/closed_call/convert_element_type`;
folded: `backward TransformerLM.hidden/layer_*/attention/convert_element_type`.
"""
import functools
import re

from allatt_jax.perf import hlo_text

# The model's parts whose shares are reported, by a pattern of their folded path: the
# output layer (the adaptive or tied softmax's loss, `*.nll`, with the log-sum-exp and
# target logits below it) and the attention (every layer's `attention` module).
PARTS = {"output_layer": re.compile(r"(^|/)[\w.]*\bnll(/|$)"),
         "attention": re.compile(r"(^|/)attention(/|$)")}
REST = "rest"
# Scope components that only say how the code was traced, not where in the model.
_WRAPPERS = re.compile(r"^(while|body|cond|closed_call|checkpoint|remat|"
                       r"rematted_computation|branch_\d+_fun|pjit)$")


@functools.lru_cache(maxsize=None)
def fold(op_name: str) -> str:
  """'DIRECTION path' of an op_name: DIRECTION is 'forward' or 'backward' inside the
  model's differentiation, 'step' outside it (loss scaling, gradient norms, the
  optimizer, random keys, and instructions XLA left without a name); the path has
  layer indices as layer_*, jit(f) as f, and no loop or call wrappers."""
  parts = [p for p in op_name.split("/") if p]
  if parts and parts[0].startswith("jit("):
    parts = parts[1:]   # the jitted function itself
  direction = "step"
  if parts and parts[0].startswith("transpose(jvp("):
    direction, parts = "backward", parts[1:]
  elif parts and parts[0].startswith("jvp("):
    direction, parts = "forward", parts[1:]
  parts = [re.sub(r"^jit\((.*)\)$", r"\1", re.sub(r"layer_\d+", "layer_*", p))
           for p in parts if not _WRAPPERS.match(p)]
  return f"{direction} {'/'.join(parts) or '(unnamed)'}"


@functools.lru_cache(maxsize=None)
def part(folded: str) -> str:
  """The model part (a key of PARTS, or REST) of a folded scope."""
  path = folded.partition(" ")[2]
  return next((name for name, pattern in PARTS.items() if pattern.search(path)), REST)


def of_instructions(module: hlo_text.Module) -> dict[str, tuple[str, bool]]:
  """(folded scope, whether it is not the instruction's own) of every instruction of
  the module, by name.

  XLA leaves some instructions without an op_name (on CPU, the dots of a custom
  VJP's backward pass among them): such an instruction takes the scope of the first
  operand that has one (producers come first in the printed order), else of its
  first user that has one, else none ('step (unnamed)'); the last component of a
  scope so found says what the instruction is, in brackets: '.../attention/[dot]'.
  """
  named = {}
  for computation in module.computations.values():
    own = {n: module.op_name(i) for n, i in computation.instructions.items()}
    found = {n: name for n, name in own.items() if name}
    operands = lambda n: computation.instructions[n].operands
    users = lambda n: [u.name for u in computation.users(n)]
    for order, neighbours in ((computation.instructions, operands),
                              (reversed(computation.instructions), users)):
      for name in order:
        source = next((o for o in neighbours(name) if o in found), None)
        if name not in found and source:
          found[name] = (f"{found[source].rpartition('/')[0]}/"
                         f"[{_what(module, computation.instructions[name])}]")
    named.update({n: (fold(found.get(n, "")), not own[n])
                  for n in computation.instructions})
  return named


def _what(module: hlo_text.Module, instruction: hlo_text.Instruction) -> str:
  """An instruction's opcode, a fusion's root's."""
  if instruction.opcode != "fusion":
    return instruction.opcode
  body = module.computations[instruction.called[0]]
  return body.instructions[body.root].opcode
