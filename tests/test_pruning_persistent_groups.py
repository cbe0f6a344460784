"""Gates on groups of persistent slots: their variables, the softmax without closed
groups, the export that cuts them, their costs and the budget's rule over both kinds."""
import dataclasses
import math
import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import GROUP_LOGITS
from helpers import HEAD_LOGITS
from helpers import export_scoring
from allatt_jax.model.attention import relative
from allatt_jax.model.attention import xla_core
from allatt_jax.model import gates as gates_lib
from allatt_jax.pruning import budget
from allatt_jax.pruning import freeze
from allatt_jax.config import config_base
from allatt_jax.training import config_checks
from allatt_jax.pruning import gate_values
from allatt_jax.pruning import cost_model
from allatt_jax.model import transformer as model_lib
from allatt_jax.pruning import head_removal
from allatt_jax.pruning import model_export
from allatt_jax.config import run_config
from allatt_jax.runs import run_files
from allatt_jax.config.errors import CheckpointError
from allatt_jax.config.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]

VOCAB = 41
SEQ_LEN = 8
GROUP = 2          # slots per group: 4 groups of the 8 slots of each head
HARD = run_config.GatesSection(hard=True, persistent_group=GROUP)


def make_cfg(gate=HARD, **overrides):
  base = dict(kind="allatt", vocab_size=VOCAB, num_layers=2, d_model=32, num_heads=4,
              num_persistent=8, max_relative_len=64, gated=True, gate=gate)
  base.update(overrides)
  return model_lib.ModelConfig(**base)


def init_variables(cfg, batch=2):
  tokens_BxT = jnp.zeros((batch, SEQ_LEN), jnp.int32)
  return nn.unbox(model_lib.TransformerLM(cfg).init(
      jax.random.key(0), tokens_BxT, tokens_BxT, model_lib.init_memory(cfg, batch, SEQ_LEN)))


def gated_model(gate=HARD):
  """A gated model with the logits above and every parameter perturbed."""
  cfg = make_cfg(gate)
  variables = init_variables(cfg)
  leaves, treedef = jax.tree.flatten(variables["params"])
  keys = jax.random.split(jax.random.key(1), len(leaves))
  params = treedef.unflatten(
      [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
  gates = {}
  for i in range(cfg.num_layers):
    layer = {"persistent_logits": jnp.array(GROUP_LOGITS[i])}
    if gate.heads:
      layer["logits"] = jnp.array(HEAD_LOGITS[i])
    gates[f"layer_{i}"] = {"attention": layer}
  return cfg, {"params": params, "gates": gates}


def tokens(seed, shape):
  return jax.random.randint(jax.random.key(seed), shape, 0, VOCAB)


def test_group_gates_live_beside_the_head_gates_in_the_gates_collection():
  variables = init_variables(make_cfg())
  layer = variables["gates"]["layer_0"]["attention"]
  assert layer["logits"].shape == (4,)
  assert layer["persistent_logits"].shape == (4, 8 // GROUP)
  np.testing.assert_array_equal(layer["persistent_logits"], HARD.init)
  groups_only = init_variables(make_cfg(dataclasses.replace(HARD, heads=False)))
  assert set(groups_only["gates"]["layer_1"]["attention"]) == {"persistent_logits"}
  # Off (the default) and ungated models have none.
  heads_only = init_variables(make_cfg(run_config.GatesSection()))
  assert set(heads_only["gates"]["layer_0"]["attention"]) == {"logits"}
  assert "gates" not in init_variables(make_cfg(gated=False))


def _core_inputs(h=3, b=2, t=5, s=4, dh=8, n=6):
  rng = iter(jax.random.split(jax.random.key(0), 9))
  normal = lambda shape: jax.random.normal(next(rng), shape)
  k = s + t
  return dict(qu=normal((h, b, t, dh)), qv=normal((h, b, t, dh)), qp=normal((h, b, t, dh)),
              k=normal((h, b, k, dh)), v=normal((h, b, k, dh)),
              r_pad=jnp.pad(normal((h, k, dh)), [(0, 0), (1, 0), (0, 0)]),
              pk=normal((h, n, dh)), pv=normal((h, n, dh)),
              mask=relative.attention_mask(t, s, jnp.int32(2), False))


def test_closed_slots_take_no_mass_as_if_they_were_not_there():
  x = _core_inputs()
  open_HxN = np.array([[1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
  # A large logit on a closed slot must not matter either.
  pk = x["pk"].at[0, 1].multiply(50.0)
  p_ctx, p_pers = xla_core.attention_weights(
      x["qu"], x["qv"], x["qp"], x["k"], x["r_pad"], pk, x["mask"],
      pw=jnp.asarray(open_HxN, jnp.float32))
  assert np.all(np.asarray(p_pers)[~np.broadcast_to(open_HxN[:, None, None], p_pers.shape)]
                == 0.0)
  for h, open_N in enumerate(open_HxN):
    kept = np.flatnonzero(open_N)
    head = lambda a: a[h:h + 1]
    expected_ctx, expected_pers = xla_core.attention_weights(
        head(x["qu"]), head(x["qv"]), head(x["qp"]), head(x["k"]), head(x["r_pad"]),
        head(pk)[:, kept] if kept.size else None, x["mask"])
    np.testing.assert_allclose(p_ctx[h:h + 1], expected_ctx, rtol=1e-6, atol=1e-7)
    if kept.size:
      np.testing.assert_allclose(p_pers[h:h + 1][..., kept], expected_pers, rtol=1e-6,
                                 atol=1e-7)
    # Every query's weights still sum to one.
    total = np.asarray(p_ctx[h]).sum(-1) + np.asarray(p_pers[h]).sum(-1)
    np.testing.assert_allclose(total[np.asarray(x["mask"]).any(-1)[None].repeat(2, 0)],
                               1.0, rtol=1e-5)


def _forward_both(cfg, variables, pruned_cfg, params):
  gated_lm, pruned_lm = model_lib.TransformerLM(cfg), model_lib.TransformerLM(pruned_cfg)
  seq = tokens(2, (2, 2 * SEQ_LEN + 1))
  gated_mem = model_lib.init_memory(cfg, 2, SEQ_LEN)
  pruned_mem = model_lib.init_memory(pruned_cfg, 2, SEQ_LEN)
  for start in (0, SEQ_LEN):   # the second segment attends to the first one's memory
    x = seq[:, start:start + SEQ_LEN]
    y = seq[:, start + 1:start + SEQ_LEN + 1]
    gated_nll, gated_mem, _ = gated_lm.apply(variables, x, y, gated_mem)
    pruned_nll, pruned_mem, stats = pruned_lm.apply({"params": params}, x, y, pruned_mem)
    assert not any(stats)
    np.testing.assert_allclose(pruned_nll, gated_nll, rtol=0, atol=1e-5)
    np.testing.assert_allclose(pruned_mem["hidden"], gated_mem["hidden"], rtol=0,
                               atol=1e-5)
  return gated_nll


@pytest.mark.parametrize("heads", [True, False], ids=["heads_and_groups", "groups_only"])
def test_export_equals_the_gated_model_with_uneven_groups_per_head(heads):
  cfg, variables = gated_model(dataclasses.replace(HARD, heads=heads))
  pruned_cfg, params = head_removal.remove_heads(cfg, variables)
  # Kept heads ordered by their slots, most first; head 2 of layer 0 keeps none.
  expected = ((8, 4, 2, 0), (8, 6, 4, 2)) if not heads else ((8, 4, 0), (8, 6, 4, 2))
  assert pruned_cfg.persistent_slots == expected
  assert pruned_cfg.layer_heads == tuple(len(s) for s in expected)
  assert params["layer_0"]["attention"]["persistent_key"].shape == (len(expected[0]), 8, 8)
  gated_nll = _forward_both(cfg, variables, pruned_cfg, params)
  # The groups matter: with every group open the outputs differ.
  all_open = jax.tree.map(lambda x: x, variables)
  for i in range(cfg.num_layers):
    all_open["gates"][f"layer_{i}"]["attention"]["persistent_logits"] = jnp.full((4, 4), 5.0)
  seq = tokens(2, (2, 2 * SEQ_LEN + 1))
  memory = model_lib.init_memory(cfg, 2, SEQ_LEN)
  lm = model_lib.TransformerLM(cfg)
  _, memory, _ = lm.apply(variables, seq[:, :SEQ_LEN], seq[:, 1:SEQ_LEN + 1], memory)
  open_nll, _, _ = lm.apply(all_open, seq[:, SEQ_LEN:2 * SEQ_LEN],
                            seq[:, SEQ_LEN + 1:], memory)
  assert np.abs(open_nll - gated_nll).max() > 1e-3


def test_an_export_with_uneven_slots_prunes_and_costs_as_it_runs():
  cfg, variables = gated_model()
  pruned_cfg, params = head_removal.remove_heads(cfg, variables)
  # Its heads can be cut again (the slots go with them), and slots by hand.
  smaller_cfg, smaller = head_removal.remove_heads(pruned_cfg, {"params": params}, {1: [0]},
                                                   slots={0: {0: [0, 1, 7]}})
  assert smaller_cfg.persistent_slots == ((5, 4, 0), (6, 4, 2))
  assert smaller_cfg.layer_slots == [9, 12] and cfg.layer_slots == [32, 32]
  # Parameters count the slots kept, not the padding each layer's arrays hold.
  padding = cost_model.padding_slots(smaller_cfg)
  assert padding == (5 * 3 - 9) + (6 * 3 - 12)
  tree = sum(np.size(x) for x in jax.tree.leaves(smaller))
  counts = cost_model.param_counts(smaller_cfg)
  assert counts["params_total"] == tree - 2 * smaller_cfg.head_dim * padding
  expected = sum(cost_model.layer_param_count(smaller_cfg, h, sum(s)) for h, s in
                 zip(smaller_cfg.layer_heads, smaller_cfg.persistent_slots))
  assert counts["params_non_embedding"] == expected
  with pytest.raises(Exception, match="no persistent slot"):
    head_removal.remove_heads(pruned_cfg, {"params": params}, slots={0: {2: [0]}})


@pytest.mark.slow   # saves a model and scores it
def test_an_exports_results_name_the_slots_it_keeps_and_its_model_reads_them(tmp_path):
  """What results.json tells of a group-gated model's export, and the export's own
  config, against the slots its gates keep (`head_removal`)."""
  cfg, variables = gated_model()
  pruned_cfg, _ = head_removal.remove_heads(cfg, variables)
  config, corpus, mesh = export_scoring(cfg, SEQ_LEN, persistent_group=GROUP)
  results = model_export.export_and_evaluate(tmp_path / "export", config, cfg, variables,
                                             corpus, mesh)
  assert results["heads_per_layer"] == list(pruned_cfg.layer_heads)
  assert results["persistent_per_layer"] == pruned_cfg.layer_slots != cfg.layer_slots
  assert results["directory"] == str(tmp_path / "export")
  assert {"valid", "test", "valid_nll", "test_nll"} <= set(results)
  saved = model_lib.ModelConfig.from_config(run_files.load_config(tmp_path / "export"))
  assert saved.persistent_slots == pruned_cfg.persistent_slots and not saved.gated


@pytest.mark.parametrize("key", ["target_params", "target_macs"])
def test_unit_costs_add_up_to_the_cost_model(key):
  cfg = make_cfg(gated=False, gate=run_config.GatesSection())
  lengths = (SEQ_LEN, SEQ_LEN, 2)
  units = cost_model.UnitCosts.of(cfg, key, lengths, GROUP)
  measure = lambda c: cost_model._budget_cost(c, key, lengths)
  assert units.cost(cfg.layer_heads, [16, 16]) == pytest.approx(measure(cfg))
  assert units.cost((0, 0), (0, 0)) == pytest.approx(units.empty)
  slots = ((8, 4, 2), (6, 0, 0, 0))
  pruned = dataclasses.replace(cfg, heads_per_layer=(3, 4), persistent_slots=slots)
  groups = [sum(s) // GROUP for s in slots]
  assert units.cost((3, 4), groups) == pytest.approx(measure(pruned))
  assert units.full_head == pytest.approx(units.head + 4 * units.group)
  # The controller's count: heads with all their groups, as if every layer kept a head.
  assert units.size_of(units.cost(cfg.layer_heads, [16, 16]), 2) == pytest.approx(8)
  assert units.size_of(units.cost((3, 4), (4, 16)), 2) == pytest.approx(
      7 - 8 * units.group / units.full_head)


@pytest.mark.parametrize("key", ["target_params", "target_macs"])
@pytest.mark.parametrize("model_group", [GROUP // 2, 2 * GROUP])
def test_unit_costs_of_groups_of_another_size_than_the_models_gates(key, model_group):
  # An experiment plan may price groups of another size than the gated model's own.
  lengths = (SEQ_LEN, SEQ_LEN, 2)
  gated = make_cfg(gate=dataclasses.replace(HARD, persistent_group=model_group))
  ungated = make_cfg(gated=False, gate=run_config.GatesSection())
  assert cost_model.UnitCosts.of(gated, key, lengths, GROUP) == cost_model.UnitCosts.of(
      ungated, key, lengths, GROUP)


# Unit costs for the rank rule's tests: a head 10, a group 1, layers free.
_Units = cost_model.UnitCosts("target_macs", empty=0.0, layer=0.0, head=10.0, group=1.0,
                              groups_per_head=4)


def _decide(budget_value, heads=HEAD_LOGITS, groups=GROUP_LOGITS, gate=HARD, units=_Units):
  cfg = make_cfg(gate)
  gates = {f"layer_{i}": {"attention": {"logits": np.array(heads[i], np.float32),
                                        "persistent_logits": np.array(groups[i], np.float32)}}
           for i in range(2)}
  decided = freeze.keep_within_budget(cfg, gate_values.read(cfg, gates), units,
                                      budget_value)
  return cfg, gates, decided


def _kept(cfg, new_gates):
  pruned_cfg, _ = head_removal.remove_heads(cfg, {"params": init_variables(cfg)["params"],
                                                  "gates": new_gates})
  return pruned_cfg


def test_the_rule_keeps_the_gates_decision_where_it_fits_and_nothing_more_would():
  # The gates keep 7 heads and, of those, 4+0+2 + 3+4+2+1 = 16 groups: 86.
  cfg, gates, (new_gates, decision) = _decide(86.5)
  assert decision["changed"] == 0 and decision["cost"] == decision["cost_by_gates"] == 86
  assert (decision["allowed"], decision["groups"]) == (7, 16)
  np.testing.assert_equal(new_gates, gates)
  # With room for one more group, the best-ranked closed one opens.
  _, _, (_, decision) = _decide(87.0)
  assert decision["opened"] == [[0, 2, 2]] and decision["cost"] == 87


def test_a_budget_of_exactly_the_gates_cost_keeps_them_whatever_its_sum_rounds_to():
  """Costs in MACs per token are fractions: at 0.1 a head and 0.2 a group, the gates'
  7 heads and 16 groups cost 3.9, which the rule's running sum reaches as
  3.9000000000000012. A budget of 3.9 keeps them as they are."""
  units = cost_model.UnitCosts("target_macs", empty=0.0, layer=0.0, head=0.1, group=0.2,
                               groups_per_head=4)
  _, gates, (new_gates, decision) = _decide(3.9, units=units)
  assert decision["changed"] == 0 and (decision["allowed"], decision["groups"]) == (7, 16)
  assert decision["cost"] == pytest.approx(3.9)
  np.testing.assert_equal(new_gates, gates)


def test_group_logits_of_another_shape_are_refused():
  gates = {f"layer_{i}": {"attention": {
      "logits": np.array(HEAD_LOGITS[i], np.float32),
      "persistent_logits": np.zeros((4, 5 if i else 4), np.float32)}} for i in range(2)}
  with pytest.raises(CheckpointError, match=(
      r"The gates of layer_1 hold shape \(4, 5\) at gates/layer_1/attention/"
      r"persistent_logits, but the config gives that layer 4 heads of 4 persistent groups")):
    gate_values.read(make_cfg(), gates)


def test_a_soft_group_gate_keeps_its_slots_while_it_is_above_zero():
  """Soft gates: a group whose deterministic gate is 0.22 (π = −1) still weighs its
  slots, so it is open and its slots are kept; one clipped to 0 (π = −3) is not."""
  soft = run_config.GatesSection(hard=False, persistent_group=GROUP)
  group_logits_G = np.array([-1.0, -3.0, 0.0, 3.0], np.float32)
  gates = {f"layer_{i}": {"attention": {
      "logits": np.full((4,), 3.0, np.float32),
      "persistent_logits": np.tile(group_logits_G, (4, 1))}} for i in range(2)}
  read = gate_values.read(make_cfg(soft), gates)
  values_G = np.asarray(gates_lib.deterministic(jnp.asarray(group_logits_G), soft))
  assert 0 < values_G[0] < 0.5 and values_G[1] == 0
  for open_HxG, slots in zip(read.groups_open, read.kept_slots):
    np.testing.assert_array_equal(open_HxG, np.tile([True, False, True, True], (4, 1)))
    assert [s.tolist() for s in slots] == [[0, 1, 4, 5, 6, 7]] * 4


def test_a_headless_layer_of_a_group_gated_model_has_no_group_gates():
  """A layer whose heads are all gone (a re-pruned export) holds no gates: it reads as
  no heads and no groups, not as a gates collection that lacks them."""
  cfg = make_cfg(heads_per_layer=(4, 0))
  variables = init_variables(cfg)
  assert "layer_1" not in variables["gates"]
  read = gate_values.read(cfg, variables["gates"])
  assert read.group_logits[1] is None and read.groups_open[1] is None
  assert read.kept_slots[1] is None and read.surviving_heads[1].size == 0
  assert read.groups_open[0].shape == (4, 4) and len(read.kept_slots[0]) == 4


def test_the_rule_ends_at_or_just_under_the_budget_by_logit_rank():
  cfg, gates, (new_gates, decision) = _decide(80.0)
  assert decision["cost"] <= 80.0
  # Nothing left out would still fit: every closed unit costs more than what is left.
  assert 80.0 - decision["cost"] < 1.0
  # The lowest-ranked open units went first: groups of logit 0.5 and 1.0 (layer 0
  # head 0; layer 1 heads 0 and 3), ranked min(group, head) ...
  pruned_cfg = _kept(cfg, new_gates)
  assert sum(map(sum, pruned_cfg.persistent_slots)) // GROUP == decision["groups"]
  assert decision["cost"] == 10 * decision["allowed"] + decision["groups"]
  # ... and applying the rule again changes nothing.
  _, again = freeze.keep_within_budget(cfg, gate_values.read(cfg, new_gates), _Units,
                                       80.0)
  assert again["changed"] == 0 and again["cost"] == decision["cost"]


def test_a_group_ranks_no_higher_than_its_head_and_dies_with_it():
  heads = ((3.0, -4.0, 1.0, 2.0), (2.0, 2.0, 2.0, 0.1))
  groups = (GROUP_LOGITS[0], ((1.0, 1.0, -1.0, 1.0), (1.0, 2.0, 3.0, 4.0),
                              (-1.0, 2.0, 2.0, -3.0), (5.0, 5.0, 5.0, 5.0)))
  # A budget of 70: the head of logit 0.1 (layer 1, head 3) ranks below every other
  # open unit, so its groups (logit 5, ranked 0.1) cannot keep it.
  cfg, _, (new_gates, decision) = _decide(70.0, heads, groups)
  assert [1, 3] in decision["closed"]
  assert decision["cost"] <= 70.0 and 70.0 - decision["cost"] < 1.0
  assert _kept(cfg, new_gates).layer_heads == (3, 3)


def test_a_budget_above_the_gates_reopens_by_rank_what_fits():
  # 86 by the gates. The closed head (0, 1) at -0.2 ranks above every closed group:
  # it reopens (10) with its one open group (logit 2, ranked -0.2: 1); the next
  # group (-0.5) no longer fits 97.5.
  heads = ((3.0, -0.2, 1.0, 2.0), HEAD_LOGITS[1])
  _, _, (_, decision) = _decide(97.5, heads)
  assert decision["opened"] == [[0, 1]] and decision["cost"] == 97
  assert decision["groups"] == 17
  # At -4 it ranks below them: the groups fill what is left first, and then the head
  # no longer fits.
  _, _, (_, decision) = _decide(101.0)
  assert decision["cost"] == 98 and [0, 1] not in decision["opened"]
  assert len(decision["opened"]) == 12


def test_the_decision_line_says_which_kind_each_change_is_and_adds_up():
  """A head opened brings the groups its gates keep open, a head closed takes them
  along, with no decision of their own: the line names both kinds and those groups,
  so the totals it reports add up."""
  heads = ((3.0, -0.2, 1.0, 2.0), HEAD_LOGITS[1])
  cfg = make_cfg()
  gates = {f"layer_{i}": {"attention": {"logits": np.array(heads[i], np.float32),
                                        "persistent_logits": np.array(GROUP_LOGITS[i],
                                                                      np.float32)}}
           for i in range(2)}
  penalty = budget.Penalty(optax.constant_schedule(0.0), HARD, allowed=97.5, units=_Units)
  _, decision, line = freeze.keep_budgeted(cfg, gate_values.read(cfg, gates),
                                           penalty)
  assert line.endswith("the gates keep 7 of 8 heads and 16 of 32 persistent groups at "
                       "the freeze (86); the budget 98 keeps 8 heads and 17 groups (97): "
                       "1 decision(s) changed by logit rank (opened 1 head(s) with their "
                       "1 open group(s); closed none)"), line
  # One unit over: the lowest-ranked open group closes, and the line says which kind.
  penalty = dataclasses.replace(penalty, allowed=85.0)
  _, decision, line = freeze.keep_budgeted(cfg, gate_values.read(cfg, gates), penalty)
  assert [len(unit) for unit in decision["closed"]] == [3] and decision["cost"] == 85
  assert line.endswith("1 decision(s) changed by logit rank (opened none; closed 1 "
                       "persistent group(s))"), line
  for budget_value, head_logits in ((80.0, HEAD_LOGITS), (70.0, ((3.0, -4.0, 1.0, 2.0),
                                                                 (2.0, 2.0, 2.0, 0.1))),
                                    (101.0, HEAD_LOGITS), (97.5, heads)):
    _, _, (_, decision) = _decide(budget_value, head_logits)
    groups = lambda units: sum(len(unit) == 3 for unit in units)
    assert (decision["groups_by_gates"] + decision["groups_with_opened"]
            - decision["groups_with_closed"] + groups(decision["opened"])
            - groups(decision["closed"])) == decision["groups"], budget_value


def test_the_decision_line_says_when_the_heads_alone_met_the_budget():
  """A group budget may keep every slot of the heads it keeps: the user asked to prune
  groups too, and the line says that none was."""
  heads = ((3.0, -4.0, 1.0, 2.0), (2.5, 1.5, 0.5, 0.2))
  groups = (((5.0,) * 4,) * 4,) * 2
  cfg = make_cfg()
  gates = {f"layer_{i}": {"attention": {"logits": np.array(heads[i], np.float32),
                                        "persistent_logits": np.array(groups[i], np.float32)}}
           for i in range(2)}
  line = lambda budget_value: freeze.keep_budgeted(cfg, gate_values.read(cfg, gates),
                                                   budget.Penalty(
      optax.constant_schedule(0.0), HARD, allowed=budget_value, units=_Units))[2]
  # Each head ranks just above its groups: 42 keeps 3 heads and all their 12 groups.
  assert line(42.0).endswith(
      "the budget 42 keeps 3 heads and 12 groups (42), every kept head with all its "
      "persistent slots: no group pruned: 4 decision(s) changed by logit rank (opened "
      "none; closed 4 head(s) with their 16 open group(s))"), line(42.0)
  assert "no group pruned" not in line(41.0)      # 3 heads, 11 groups


@pytest.mark.parametrize("gate, budget_value", [
    (HARD, 38.0), (HARD, 62.0), (HARD, 97.5),
    (dataclasses.replace(HARD, heads=False), 97.5)])
def test_a_layers_first_head_pays_for_the_layer(gate, budget_value):
  """With layers that cost something (their LayerNorm's parameters), what the rule
  keeps costs exactly what it says, within the budget: the first head kept in a
  layer pays for the layer too, and with only groups gated every head and layer is
  paid for before any group."""
  units = dataclasses.replace(_Units, empty=3.0, layer=5.0)
  cfg, _, (new_gates, decision) = _decide(budget_value, gate=gate, units=units)
  pruned_cfg = _kept(cfg, new_gates)
  slots = pruned_cfg.persistent_slots or [[cfg.num_persistent] * h
                                          for h in pruned_cfg.layer_heads]
  groups = [sum(layer) // GROUP for layer in slots]
  assert decision["cost"] == units.cost(pruned_cfg.layer_heads, groups) <= budget_value
  assert (decision["allowed"], decision["groups"]) == (sum(pruned_cfg.layer_heads),
                                                        sum(groups))


def test_groups_only_keeps_every_head_and_fills_with_groups():
  gate = dataclasses.replace(HARD, heads=False)
  cfg, _, (new_gates, decision) = _decide(85.0, gate=gate)
  assert decision["allowed"] == 8 and decision["groups"] == 5
  assert set(new_gates["layer_0"]["attention"]) == {"persistent_logits"}
  assert _kept(cfg, new_gates).layer_heads == (4, 4)


@pytest.mark.parametrize("gate", [dataclasses.replace(HARD, heads=False, open_at_zero=False),
                                  dataclasses.replace(HARD, heads=False, hard=False)],
                         ids=["closed_at_zero", "soft"])
def test_heads_without_gates_read_as_open_for_certain_and_unscaled(gate):
  """With only groups gated, every head counts fully open whatever the gates' mode:
  a logit of 0 would close it (`open_at_zero=False`) or half-open it (soft gates)."""
  cfg, variables = gated_model(gate)
  read = gate_values.read(cfg, variables["gates"])
  for values, factors in zip(read.head_values, read.out_factors):
    np.testing.assert_array_equal(values, np.ones(4))
    np.testing.assert_array_equal(factors, np.ones(4))
  assert [h.tolist() for h in read.surviving_heads] == [[0, 1, 2, 3]] * 2


def test_l0_and_controller_count_heads_and_groups_by_cost():
  share = 0.25
  stats = [{"open_prob": jnp.array([1.0, 0.5]),
            "persistent_open_prob": jnp.array([[1.0, 1.0], [0.0, 1.0]])},
           {"persistent_open_prob": jnp.array([[0.5, 0.5]])}, {}]
  # Head 0: 1 · (1 − 0.5 + 0.5); head 1: 0.5 · (0.5 + 0.25); heads not gated count 1.
  expected = 1.0 + 0.5 * 0.75 + (0.5 + 0.25)
  np.testing.assert_allclose(model_lib.l0_penalty(stats, share), expected)
  assert float(model_lib.l0_penalty(stats[:1])) == 1.5   # heads only: unchanged
  gates = {"layer_0": {"attention": {"logits": jnp.array([30.0, -30.0]),
                                     "persistent_logits": jnp.array([[30.0, -30.0]] * 2)}}}
  np.testing.assert_allclose(budget.expected_size(HARD, gates, share), 0.75, atol=1e-6)


@pytest.mark.parametrize("heads", [True, False], ids=["heads_and_groups", "groups_only"])
def test_the_group_controller_steers_the_sharpened_size_from_the_gates_init(heads):
  """With groups gated, the controller steers Σ_h P_h·(1 − s·(n − Σ_g Q_hg)) with P and
  Q sharpened as the heads' count is (P = 1 without head gates); its target moves from
  that size at the gates' init to the budget in heads, counted over the layers that
  hold heads; its metrics report each multiplier."""
  units = cost_model.UnitCosts("target_params", empty=3.0, layer=5.0, head=10.0,
                               group=1.0, groups_per_head=4)
  gate = run_config.GatesSection(enabled=True, heads=heads, persistent_group=GROUP,
                                 target_params=100.0, freeze_step=100,
                                 budget_warmup_steps=60, budget_sharpness=10.0)
  layer_heads = (4, 0, 4)
  penalty = budget.Penalty.of(gate, layer_heads, allowed=100.0, units=units)
  rng = np.random.default_rng(0)
  gates = {f"layer_{i}": {"attention": {
      "persistent_logits": jnp.asarray(rng.normal(size=(4, 4)), jnp.float32),
      **({"logits": jnp.asarray(rng.normal(size=4), jnp.float32)} if heads else {})}}
           for i in (0, 2)}
  share = 1.0 / 14.0                      # a group of a head costing 10 + 4·1

  def size(head_logits_H, group_logits_HxG, k):   # one layer's, in heads
    open_H = (gates_lib.forward_open_probability(jnp.asarray(head_logits_H), gate, k)
              if heads else 1.0)
    open_HxG = gates_lib.forward_open_probability(jnp.asarray(group_logits_HxG), gate, k)
    return float(np.sum(np.asarray(open_H) * (1.0 - share * (4 - np.sum(open_HxG, 1)))))

  for step, k in ((30, 1.0), (80, 5.5), (100, 10.0)):
    want = sum(size(g["attention"].get("logits", 0.0), g["attention"]["persistent_logits"],
                    k) for g in gates.values())
    np.testing.assert_allclose(penalty.open_count({"gates": gates}, step), want, rtol=1e-5)
  init = jnp.full((4,), gate.init)
  start = 2 * size(init, jnp.full((4, 4), gate.init), 1.0)
  end = (100.0 - 3.0 - 2 * 5.0) / 14.0    # two layers hold heads, not three
  np.testing.assert_allclose([penalty.target(s) for s in (0, 30, 60, 100)],
                             [start, (start + end) / 2, end, end], rtol=1e-6)
  at_once = budget.Penalty.of(dataclasses.replace(gate, budget_warmup_steps=0),
                              layer_heads, allowed=100.0, units=units)
  np.testing.assert_allclose(at_once.target(0), end, rtol=1e-6)
  multipliers = {budget.COLLECTION: {"lambda_1": jnp.float32(0.3),
                                     "lambda_2": jnp.float32(0.7)}}
  metrics = penalty.metrics({"gates": gates, **multipliers}, 100)
  assert (float(metrics["lambda"]), float(metrics["lambda_2"])) == (
      pytest.approx(0.3), pytest.approx(0.7))


@pytest.mark.parametrize("rate,head_block,remat", [(0.0, 3, False), (0.3, 1, False),
                                                   (0.3, 3, True)])
def test_the_core_backward_with_slot_weights_is_autodiff_of_its_forward(rate, head_block,
                                                                        remat):
  """The hand-written backward pass, slot weights included (a closed slot's ∂L/∂w is
  the gradient a straight-through gate needs to reopen it), equals autodiff."""
  x = _core_inputs()
  # Closed, open and (as a soft gate would give) fractional slot weights; a head all closed.
  pw_HxN = jnp.array([[1, 0, 1, 0.5, 0, 1], [0, 0, 0, 0, 0, 0], [1, 1, 0.25, 1, 1, 0]],
                     jnp.float32)
  args = (x["qu"], x["qv"], x["qp"], x["k"], x["v"], x["r_pad"], x["pk"], x["pv"])
  keys = jnp.array([[5, 6], [7, 8]], jnp.uint32) if rate else None
  custom = lambda *a: xla_core.attend(rate, head_block, remat, jnp.float32,
                                      *a[:-1], x["mask"], keys, a[-1])
  plain = lambda *a: xla_core._attend_fwd(rate, 3, False, jnp.float32, *a[:-1],
                                          x["mask"], keys, a[-1])[0]
  out, custom_vjp = jax.vjp(custom, *args, pw_HxN)
  expected_out, plain_vjp = jax.vjp(plain, *args, pw_HxN)
  np.testing.assert_allclose(out, expected_out, rtol=1e-6, atol=1e-6)
  dout = jax.random.normal(jax.random.key(3), out.shape)
  grads, expected_grads = custom_vjp(dout), plain_vjp(dout)
  for got, expected in zip(grads, expected_grads):
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)
  # The closed slots have a gradient (to reopen); their vectors none (they take no mass).
  assert np.abs(np.asarray(grads[-1])[pw_HxN == 0]).min() > 0
  np.testing.assert_array_equal(np.asarray(grads[7])[1], 0.0)



def _group_config(**gates):
  config = config_base.load(ROOT / "configs" / "demo.py", "tiny")   # N = 16
  config.model.vocab_size = 27
  config.gates.update({"enabled": True, "persistent_group": 4, "freeze_step": 20, **gates})
  return config


@pytest.mark.parametrize("gates, model, match", [
    (dict(persistent_group=0, heads=False), {}, r"heads=False leaves the heads without "
     r"gates.*Set --config.gates.persistent_group=64"),
    (dict(persistent_group=5), {}, r"does not divide config.model.num_persistent=16.*"
     r"Choose one of \[1, 2, 4, 8, 16\]"),
    (dict(hard=False), {}, r"needs hard gates.*--config.gates.hard=True"),
    (dict(target_sparsity=0.5), {}, r"target_sparsity=0.5 is a fraction of heads.*"
     r"--config.gates.target_params or --config.gates.target_macs"),
    # A TXL has no persistent slots, whatever num_persistent says.
    ({}, dict(kind="txl", num_persistent=16, d_ff=64), r"this model has none of "
     r"\(config.model.kind='txl', num_persistent=16\)"),
    ({}, dict(num_persistent=0), r"this model has none of \(config.model.kind='allatt', "
     r"num_persistent=0\)"),
    ({}, dict(persistent_slots=((16, 8, 16, 16), (16, 16, 16, 16))),
     r"needs every head's 16 persistent slots, but this model \(an export\) keeps "
     r"\[56, 64\] per layer"),
    (dict(heads=False, target_macs=1.0), {}, r"below the .* that pruning persistent "
     r"groups alone leaves.*The smallest budget that is met: --config.gates.target_macs="),
    (dict(target_params=10), {}, r"no head holds"),
])
def test_bad_group_configs_are_refused_with_the_fix(gates, model, match):
  config = _group_config(**gates)
  config.model.update(model)
  with pytest.raises(ConfigError, match=match):
    config_checks.check_config(run_config.RunConfig.of(config), 1)


def test_a_fixed_lambda_prices_heads_and_groups_in_parameters():
  run = run_config.RunConfig.of(_group_config(lam=0.1))
  cfg = model_lib.ModelConfig.from_config(run)
  e = run.eval
  assert cost_model.budget_units(run, cfg) == cost_model.UnitCosts.of(
      cfg, "target_params", (e.seq_len, e.mem_len, e.batch_size),
      run.gates.persistent_group)


def test_a_groups_only_budget_below_its_floor_names_one_that_is_met():
  # Eval rows of 3: the relative projection's share, K / (B·T) of it, makes the
  # floor a fraction, which the budget named must round up, not down.
  config = _group_config(heads=False, target_macs=1.0)
  config.eval.batch_size = 3
  run = run_config.RunConfig.of(config)
  cfg = model_lib.ModelConfig.from_config(run)
  floor = cost_model.budget_units(run, cfg).cost(cfg.layer_heads, (0, 0))
  assert floor != int(floor)
  with pytest.raises(ConfigError) as error:
    config_checks.check_config(run, 1)
  named = re.search(r"smallest budget that is met: --config.gates.target_macs=(\d+) ",
                    str(error.value))
  config.gates.target_macs = float(named.group(1))
  config_checks.check_config(run_config.RunConfig.of(config), 1)
  # Just under the floor is under it.
  config.gates.target_macs = floor - 0.5
  with pytest.raises(ConfigError, match="that pruning persistent groups alone leaves"):
    config_checks.check_config(run_config.RunConfig.of(config), 1)


def test_a_group_budget_below_what_no_head_holds_names_that_floor_when_empty_is_allowed():
  run = run_config.RunConfig.of(_group_config(target_params=1))
  units = cost_model.budget_units(run, model_lib.ModelConfig.from_config(run))
  with pytest.raises(ConfigError) as error:
    config_checks.check_config(run, 1)
  assert (f"smallest budget that is met: --config.gates.target_params="
          f"{math.ceil(units.empty + units.layer + units.head)};") in str(error.value)
  empty = run_config.RunConfig.of(_group_config(target_params=1, allow_empty=True))
  with pytest.raises(ConfigError) as error:
    config_checks.check_config(empty, 1)
  assert (f"smallest budget that is met: --config.gates.target_params="
          f"{math.ceil(units.empty)}.") in str(error.value), str(error.value)


def test_a_baseline_ignores_the_persistent_group_of_its_gates_section():
  """Gates turned off gate nothing: a group size that would not divide N is no error."""
  config = _group_config(persistent_group=5, hard=False)
  config.gates.enabled = False
  config_checks.check_config(run_config.RunConfig.of(config), 1)


def test_a_group_config_passes_its_checks_with_the_default_core():
  config = _group_config(lam=0.1)
  assert config.model.attention_impl == "auto"   # the XLA or split core: both weight slots
  config_checks.check_config(run_config.RunConfig.of(config), 1)


def test_a_config_saved_before_group_gates_reads_them_off():
  saved = run_config.RunConfig.of(config_base.base_config()).to_dict()
  del saved["gates"]["persistent_group"], saved["gates"]["heads"]
  del saved["model"]["persistent_slots"]
  config = run_config.RunConfig.from_dict(saved)
  assert (config.gates.persistent_group, config.gates.heads) == (0, True)
  assert config.model.persistent_slots is None
  cfg = model_lib.ModelConfig.from_config(config)
  assert cfg.gate.persistent_group == 0 and cfg.persistent_slots is None
