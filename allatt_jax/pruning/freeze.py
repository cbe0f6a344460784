"""A budget's rank rule at the freeze: the heads (and persistent groups) a budget keeps,
decided from the gates as `gate_values.read` gives them, and the line that reports it
(no I/O).

With heads alone (`keep_open_heads`) the budget allows n* heads: the heads ranked by
logit over all layers, the top n* survive. With persistent groups
(`keep_within_budget`) the rule ends a params or MACs budget exactly: at or just under
it, with no pruned unit left that would still fit. Every unit is ranked and the
ranking walked once, each unit kept while it fits: a head ranks by π_h, a group by
min(π_g, π_h) (never before its head); ties: heads, then lower layer, head, group; a
group of an unkept head is not kept; ungated heads are kept and paid for first. Ranked
by logit, not logit per cost: the L0 term already charged each gate its unit's cost
(`budget.expected_size`). Open units (π >= 0) rank above closed ones, so a fitting
decision of the gates is kept as is; and both rules are idempotent (reversed decisions
get logits of ±`gate_values.CERTAIN_LOGIT`).
"""
from allatt_jax.pruning import budget
from allatt_jax.config import errors
from allatt_jax.pruning import gate_values
from allatt_jax.model import transformer as model_lib

_CERTAIN_LOGIT = gate_values.CERTAIN_LOGIT


def keep_budgeted(cfg: model_lib.ModelConfig, gates: gate_values.Gates,
                  penalty: budget.Penalty) -> tuple[dict, dict, str]:
  """What the budget of `penalty` keeps of the gated model `cfg` at the freeze: (the
  new gates collection as numpy arrays, the decision, the decision in a line)."""
  num_heads = sum(cfg.layer_heads)
  if penalty.units is None:
    new_gates, decision = keep_open_heads(cfg, gates, penalty.allowed)
    return new_gates, decision, _heads_line(decision, num_heads)
  new_gates, decision = keep_within_budget(cfg, gates, penalty.units, penalty.allowed)
  return new_gates, decision, _units_line(
      decision, num_heads, num_heads * penalty.units.groups_per_head)


def keep_open_heads(cfg: model_lib.ModelConfig, gates: gate_values.Gates,
                    num_open: int) -> tuple[dict, dict]:
  """The gates with exactly `num_open` heads open by the deterministic rule.

  A budget allows n* heads; the gates, frozen wherever training left them, may keep
  more or fewer. The heads are then ranked by their logit, over all layers, and the
  top `num_open` are the survivors; among equal logits the lower layer, then the lower
  head index, ranks first. A survivor the deterministic rule closed gets a logit that
  opens it for certain, a head outside the top that the rule kept one that closes it
  for certain; every other logit is left as it is. Where the rule already keeps
  `num_open` heads nothing changes, so applying this twice changes nothing more.

  Args:
    cfg: the gated model's config.
    gates: its gates, read (`gate_values.read`).
    num_open: n*, 0 .. the model's head count.

  Returns:
    (the new gates collection as numpy arrays, the decision: 'allowed', 'by_gates'
    (the heads the deterministic rule kept), 'changed' (head decisions the budget
    reversed) and the reversed heads as [layer, head] pairs in 'opened' and 'closed').
  """
  values = gates.head_values
  logits = {i: gates.head_logits[i].copy()
            for i, heads in enumerate(cfg.layer_heads) if heads}
  heads = [(i, h) for i in logits for h in range(len(logits[i]))]
  if not 0 <= num_open <= len(heads):
    raise errors.ConfigError(f"A budget of {num_open} open heads does not fit a model "
                             f"of {len(heads)} heads.")
  ranked = sorted(heads, key=lambda ih: (-logits[ih[0]][ih[1]], ih[0], ih[1]))
  survivors = set(ranked[:num_open])
  opened = [ih for ih in heads if ih in survivors and values[ih[0]][ih[1]] <= 0]
  closed = [ih for ih in heads if ih not in survivors and values[ih[0]][ih[1]] > 0]
  for i, h in opened:
    logits[i][h] = _CERTAIN_LOGIT
  for i, h in closed:
    logits[i][h] = -_CERTAIN_LOGIT
  new_gates = {f"layer_{i}": {"attention": {"logits": logits_H}}
               for i, logits_H in logits.items()}
  decision = {"allowed": num_open, "by_gates": num_open - len(opened) + len(closed),
              "changed": len(opened) + len(closed),
              "opened": [list(ih) for ih in opened], "closed": [list(ih) for ih in closed]}
  return new_gates, decision


def keep_within_budget(cfg: model_lib.ModelConfig, gates: gate_values.Gates, units,
                       budget_value: float) -> tuple[dict, dict]:
  """The gates with exactly the heads and groups the rank rule keeps under
  `budget_value` (the module's note), in units `units` (`cost_model.UnitCosts`).

  Returns:
    (the new gates collection as numpy arrays, the decision: 'budget', 'cost' (what
    the kept units cost), 'allowed' and 'groups' (the heads and groups kept),
    'by_gates', 'groups_by_gates' and 'cost_by_gates' (the same of the gates' own
    decision), 'changed' (decisions reversed) and the reversed units, [layer, head]
    or [layer, head, group], in 'opened' and 'closed'; 'groups_with_opened' and
    'groups_with_closed', the groups open by their gates of the heads opened and
    closed, which come and go with their head without a decision of their own).
  """
  gate = cfg.gate
  layers = [(i, gates.head_logits[i], gates.head_values[i] > 0, gates.group_logits[i],
             gates.groups_open[i]) for i, heads in enumerate(cfg.layer_heads) if heads]
  units_ranked = []
  for i, heads_H, _, groups_HxG, _ in layers:
    for h, head_logit in enumerate(heads_H):
      units_ranked.append((-head_logit, 0, i, h, -1))
      units_ranked += [(-min(logit, head_logit), 1, i, h, g)
                       for g, logit in enumerate(groups_HxG[h])]
  units_ranked.sort()

  spent = units.empty
  kept_heads, kept_groups, layers_kept = set(), set(), set()
  if not gate.heads:   # every head stays: paid for before any group
    kept_heads = {(i, h) for i, heads_H, *_ in layers for h in range(len(heads_H))}
    layers_kept = {i for i, *_ in layers}
    spent += sum(units.layer + len(heads_H) * units.head for _, heads_H, *_ in layers)
  fits = lambda cost: spent + cost <= budget_value + 1e-9 * max(1.0, abs(budget_value))
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
  with_opened = with_closed = 0
  for i, heads_H, heads_open, groups_HxG, groups_open in layers:
    heads_new, groups_new = heads_H.copy(), groups_HxG.copy()
    by_gates_heads.append(int(heads_open.sum()))
    by_gates_groups.append(int(groups_open[heads_open].sum()))
    for h in range(len(heads_H)):
      keep = (i, h) in kept_heads
      if gate.heads and keep != heads_open[h]:
        (opened if keep else closed).append([i, h])
        heads_new[h] = _CERTAIN_LOGIT if keep else -_CERTAIN_LOGIT
        if keep:
          with_opened += int(groups_open[h].sum())
        else:
          with_closed += int(groups_open[h].sum())
      if not keep:
        continue   # a removed head's groups go with it, whatever their gates say
      for g in range(groups_HxG.shape[1]):
        keep_group = (i, h, g) in kept_groups
        if keep_group != groups_open[h, g]:
          (opened if keep_group else closed).append([i, h, g])
          groups_new[h, g] = _CERTAIN_LOGIT if keep_group else -_CERTAIN_LOGIT
    new_gates[f"layer_{i}"] = {"attention": {
        gate_values.GROUP_LOGITS: groups_new, **({"logits": heads_new} if gate.heads else {})}}
  decision = {
      "budget": budget_value, "cost": spent, "allowed": len(kept_heads),
      "groups": len(kept_groups), "by_gates": sum(by_gates_heads),
      "groups_by_gates": sum(by_gates_groups),
      "cost_by_gates": units.cost(by_gates_heads, by_gates_groups),
      "changed": len(opened) + len(closed), "opened": opened, "closed": closed,
      "groups_with_opened": with_opened, "groups_with_closed": with_closed}
  return new_gates, decision


def keeps_every_group(decision: dict, groups_per_head: int) -> bool:
  """Whether `keep_within_budget`'s decision keeps every persistent group of the heads
  it keeps (some heads, at least): the heads alone met the budget."""
  return bool(decision["allowed"]) and decision["groups"] == (
      decision["allowed"] * groups_per_head)


def _heads_line(decision: dict, num_heads: int) -> str:
  """`keep_open_heads`' decision on a model of `num_heads` heads, in a line."""
  line = (f"budget: the gates keep {decision['by_gates']} of {num_heads} heads at the "
          f"freeze, the budget allows {decision['allowed']}")
  if not decision["changed"]:
    return line + ": kept as they are"
  return line + (f": {decision['changed']} head decision(s) changed by logit rank "
                 f"(opened {len(decision['opened'])}, closed {len(decision['closed'])})")


def _units_line(decision: dict, num_heads: int, num_groups: int) -> str:
  """`keep_within_budget`'s decision on a model of `num_heads` heads and `num_groups`
  persistent groups, in a line."""
  line = (f"budget: the gates keep {decision['by_gates']} of {num_heads} heads and "
          f"{decision['groups_by_gates']} of {num_groups} persistent groups at the "
          f"freeze ({decision['cost_by_gates']:,.0f}); the budget {decision['budget']:,.0f} "
          f"keeps {decision['allowed']} heads and {decision['groups']} groups "
          f"({decision['cost']:,.0f})")
  if keeps_every_group(decision, num_groups // num_heads):
    line += ", every kept head with all its persistent slots: no group pruned"
  if not decision["changed"]:
    return line + ": kept as they are"
  # Each kind apart, and the groups that come and go with a head: the totals above
  # then add up (35 groups, a head opened with 2 open groups, 1 group closed: 36).
  changes = []
  for verb, units, groups_along in (
      ("opened", decision["opened"], decision["groups_with_opened"]),
      ("closed", decision["closed"], decision["groups_with_closed"])):
    heads = sum(len(unit) == 2 for unit in units)
    kinds = []
    if heads:
      kinds.append(f"{heads} head(s) with their {groups_along} open group(s)")
    if len(units) > heads:
      kinds.append(f"{len(units) - heads} persistent group(s)")
    changes.append(f"{verb} {' and '.join(kinds) or 'none'}")
  return line + (f": {decision['changed']} decision(s) changed by logit rank "
                 f"({'; '.join(changes)})")
