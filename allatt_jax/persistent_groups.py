"""Gates on groups of persistent slots: which slots a gated model keeps, and a budget's
rule at the freeze over heads and groups together (no I/O).

With `gates.persistent_group` = G, a head's N persistent slots form N/G groups (group
g: slots g·G .. (g+1)·G − 1), each gated (`.../attention/persistent_logits`, (H_i, N/G);
with `gates.heads`, heads keep `.../logits`). A slot is kept where its group's
deterministic gate is open and its head's is.

The rank rule (`keep_within_budget`) ends a params or MACs budget exactly: at or just
under it, with no pruned unit left that would still fit. Every unit is ranked and the
ranking walked once, each unit kept while it fits: a head ranks by π_h, a group by
min(π_g, π_h) (never before its head); ties: heads, then lower layer, head, group; a
group of an unkept head is not kept; ungated heads are kept and paid for first. Ranked
by logit, not logit per cost: the L0 term already charged each gate its unit's cost
(`budget.expected_size`). Open units (π >= 0) rank above closed ones, so a fitting
decision of the gates is kept as is; and the rule is idempotent (reversed decisions
get logits of ±10).
"""
import numpy as np

from allatt_jax import errors
from allatt_jax import gates as gates_lib
from allatt_jax import model as model_lib

# A gate logit far enough from 0 that its deterministic gate is exactly 1 (or, negated,
# 0) in hard and soft mode alike (prune.py's too).
CERTAIN_LOGIT = 10.0
GROUP_LOGITS = "persistent_logits"


def _layer_gates(gates, layer: int) -> dict:
  return gates.get(f"layer_{layer}", {}).get("attention", {})


def group_logits(cfg: model_lib.ModelConfig, gates) -> list[np.ndarray | None]:
  """Per layer, a float32 copy of the group gate logits (H_i, N/G); None for a layer
  without heads, or a model without such gates."""
  group = cfg.gate.persistent_group
  logits = []
  for i, heads in enumerate(cfg.layer_heads):
    if not (heads and group and cfg.gated):
      logits.append(None)
      continue
    found = _layer_gates(gates, i).get(GROUP_LOGITS)
    expected = (heads, cfg.num_persistent // group)
    if found is None or np.shape(found) != expected:
      got = "none" if found is None else f"shape {np.shape(found)}"
      raise errors.CheckpointError(
          f"The gates of layer_{i} hold {got} at gates/layer_{i}/attention/{GROUP_LOGITS}"
          f", but the config gives that layer {expected[0]} heads of {expected[1]} "
          "persistent groups; the variables do not match the config.")
    logits.append(np.array(found, np.float32))
  return logits


def kept_slots(cfg: model_lib.ModelConfig, gates) -> list[list[np.ndarray] | None]:
  """Per layer and head, the persistent slots its deterministic group gates keep
  (ascending); None for a layer when the model has no group gates."""
  group = cfg.gate.persistent_group
  kept = []
  for logits_HxG in group_logits(cfg, gates):
    if logits_HxG is None:
      kept.append(None)
      continue
    open_HxG = np.asarray(gates_lib.deterministic(logits_HxG, cfg.gate)) > 0
    kept.append([np.flatnonzero(np.repeat(open_G, group)) for open_G in open_HxG])
  return kept


def _head_logits(cfg: model_lib.ModelConfig, gates, layer: int, heads: int) -> np.ndarray:
  """A layer's head logits; heads without gates count as certainly open."""
  if not cfg.gate.heads:
    return np.full((heads,), CERTAIN_LOGIT, np.float32)
  return np.array(_layer_gates(gates, layer)["logits"], np.float32)


def keep_within_budget(cfg: model_lib.ModelConfig, gates, units,
                       budget: float) -> tuple[dict, dict]:
  """The gates with exactly the heads and groups the rank rule keeps under `budget`
  (the module's note), in units `units` (`head_costs.UnitCosts`).

  Returns:
    (the new gates collection as numpy arrays, the decision: 'budget', 'cost' (what
    the kept units cost), 'allowed' and 'groups' (the heads and groups kept),
    'by_gates', 'groups_by_gates' and 'cost_by_gates' (the same of the gates' own
    decision), 'changed' (decisions reversed) and the reversed units, [layer, head]
    or [layer, head, group], in 'opened' and 'closed').
  """
  gate, layers = cfg.gate, []
  for i, (heads, groups_HxG) in enumerate(zip(cfg.layer_heads, group_logits(cfg, gates))):
    if heads:
      layers.append((i, _head_logits(cfg, gates, i, heads), groups_HxG))
  is_open = lambda logits: np.asarray(gates_lib.deterministic(logits, gate)) > 0
  units_ranked = []
  for i, heads_H, groups_HxG in layers:
    for h, head_logit in enumerate(heads_H):
      units_ranked.append((-head_logit, 0, i, h, -1))
      units_ranked += [(-min(logit, head_logit), 1, i, h, g)
                       for g, logit in enumerate(groups_HxG[h])]
  units_ranked.sort()

  spent = units.empty
  kept_heads, kept_groups, layers_kept = set(), set(), set()
  if not gate.heads:   # every head stays: paid for before any group
    kept_heads = {(i, h) for i, heads_H, _ in layers for h in range(len(heads_H))}
    layers_kept = {i for i, _, _ in layers}
    spent += sum(units.layer + len(heads_H) * units.head for _, heads_H, _ in layers)
  fits = lambda cost: spent + cost <= budget + 1e-9 * max(1.0, abs(budget))
  for _, kind, i, h, g in units_ranked:
    if kind == 0 and (i, h) not in kept_heads:
      cost = units.head + (0.0 if i in layers_kept else units.layer)
      if fits(cost):
        kept_heads.add((i, h))
        layers_kept.add(i)
        spent += cost
    elif kind == 1 and (i, h) in kept_heads and fits(units.group):
      kept_groups.add((i, h, g))
      spent += units.group

  new_gates, opened, closed = {}, [], []
  by_gates_heads, by_gates_groups = [], []
  for i, heads_H, groups_HxG in layers:
    heads_open, groups_open = is_open(heads_H), is_open(groups_HxG)
    heads_new, groups_new = heads_H.copy(), groups_HxG.copy()
    by_gates_heads.append(int(heads_open.sum()))
    by_gates_groups.append(int(groups_open[heads_open].sum()))
    for h in range(len(heads_H)):
      keep = (i, h) in kept_heads
      if gate.heads and keep != heads_open[h]:
        (opened if keep else closed).append([i, h])
        heads_new[h] = CERTAIN_LOGIT if keep else -CERTAIN_LOGIT
      if not keep:
        continue   # a removed head's groups go with it, whatever their gates say
      for g in range(groups_HxG.shape[1]):
        keep_group = (i, h, g) in kept_groups
        if keep_group != groups_open[h, g]:
          (opened if keep_group else closed).append([i, h, g])
          groups_new[h, g] = CERTAIN_LOGIT if keep_group else -CERTAIN_LOGIT
    new_gates[f"layer_{i}"] = {"attention": {
        GROUP_LOGITS: groups_new, **({"logits": heads_new} if gate.heads else {})}}
  decision = {
      "budget": budget, "cost": spent, "allowed": len(kept_heads),
      "groups": len(kept_groups), "by_gates": sum(by_gates_heads),
      "groups_by_gates": sum(by_gates_groups),
      "cost_by_gates": units.cost(by_gates_heads, by_gates_groups),
      "changed": len(opened) + len(closed), "opened": opened, "closed": closed}
  return new_gates, decision


def decision_line(decision: dict, num_heads: int, num_groups: int) -> str:
  """`keep_within_budget`'s decision on a model of `num_heads` heads and `num_groups`
  persistent groups, in a line."""
  line = (f"budget: the gates keep {decision['by_gates']} of {num_heads} heads and "
          f"{decision['groups_by_gates']} of {num_groups} persistent groups at the "
          f"freeze ({decision['cost_by_gates']:,.0f}); the budget {decision['budget']:,.0f} "
          f"keeps {decision['allowed']} heads and {decision['groups']} groups "
          f"({decision['cost']:,.0f})")
  if not decision["changed"]:
    return line + ": kept as they are"
  return line + (f": {decision['changed']} decision(s) changed by logit rank (opened "
                 f"{len(decision['opened'])}, closed {len(decision['closed'])})")
