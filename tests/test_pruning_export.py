"""Head surgery: chosen and closed heads removed, gates folded into W_O, outputs unchanged;
the config an export is saved with."""
import dataclasses
import pathlib

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers

from allatt_jax.config import config_base
from allatt_jax.config import errors
from allatt_jax.pruning import gate_values
from allatt_jax.pruning import cost_model
from allatt_jax.model import transformer as model_lib
from allatt_jax.pruning import head_removal
from allatt_jax.pruning import model_export
from allatt_jax.config import run_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
VOCAB = 41
SEQ_LEN = 8
# Layer 0 mixes open and closed heads in both modes (-4 is closed even in soft mode,
# -1 is closed only in hard mode), layer 1 is fully closed, layer 2 fully open.
LOGITS = ((3.0, -4.0, 1.0, -1.0), (-3.0, -3.0, -3.0, -3.0), (2.0, 2.0, 2.0, 2.0))
HARD = run_config.GatesSection(hard=True)
SOFT = run_config.GatesSection(hard=False)
SOFT_UNSCALED = run_config.GatesSection(hard=False, scale_output=False)


def make_cfg(kind, gate=HARD, **overrides):
  base = dict(kind=kind, vocab_size=VOCAB, num_layers=3, d_model=32, num_heads=4,
              num_persistent=8 if kind == "allatt" else 0,
              d_ff=64 if kind == "txl" else 0, max_relative_len=64, gated=True, gate=gate)
  base.update(overrides)
  return model_lib.ModelConfig(**base)


def gated_model(kind, gate=HARD, **overrides):
  """A gated model with LOGITS as gates and every parameter perturbed.

  The perturbation makes the zero-initialised biases u, v non-zero, so slicing them
  along the wrong axis would change the outputs.
  """
  cfg = make_cfg(kind, gate, **overrides)
  tokens_BxT = jnp.zeros((2, SEQ_LEN), jnp.int32)
  variables = nn.unbox(model_lib.TransformerLM(cfg).init(
      jax.random.key(0), tokens_BxT, tokens_BxT,
      model_lib.init_memory(cfg, 2, SEQ_LEN)))
  leaves, treedef = jax.tree.flatten(variables["params"])
  keys = jax.random.split(jax.random.key(1), len(leaves))
  params = treedef.unflatten(
      [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
  gates = {f"layer_{i}": {"attention": {"logits": jnp.array(LOGITS[i])}}
           for i, h in enumerate(cfg.layer_heads) if h}
  return cfg, {"params": params, "gates": gates}


def tokens(seed, shape):
  return jax.random.randint(jax.random.key(seed), shape, 0, VOCAB)


def abstract_params(cfg):
  abstract = jax.eval_shape(
      model_lib.TransformerLM(cfg).init, jax.random.key(0),
      jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
      model_lib.init_memory(cfg, 1, 1))
  return nn.unbox(abstract["params"])


@pytest.mark.slow
@pytest.mark.parametrize("gate", [HARD, SOFT, SOFT_UNSCALED],
                         ids=["hard", "soft", "soft_unscaled"])
@pytest.mark.parametrize("kind", model_lib.KINDS)
def test_exported_model_reproduces_deterministic_gated_outputs(kind, gate):
  cfg, variables = gated_model(kind, gate)
  pruned_cfg, params = head_removal.remove_heads(cfg, variables)
  gated_lm, pruned_lm = model_lib.TransformerLM(cfg), model_lib.TransformerLM(pruned_cfg)
  seq = tokens(2, (2, 2 * SEQ_LEN + 1))
  gated_mem = model_lib.init_memory(cfg, 2, SEQ_LEN)
  pruned_mem = model_lib.init_memory(pruned_cfg, 2, SEQ_LEN)
  # Two consecutive segments: the second one attends to the first one's memory.
  for start in (0, SEQ_LEN):
    x = seq[:, start:start + SEQ_LEN]
    y = seq[:, start + 1:start + SEQ_LEN + 1]
    gated_nll, gated_next, _ = gated_lm.apply(variables, x, y, gated_mem,
                                              deterministic=True)
    pruned_nll, pruned_next, stats = pruned_lm.apply({"params": params}, x, y, pruned_mem)
    assert not any(stats)
    np.testing.assert_allclose(pruned_nll, gated_nll, rtol=0, atol=1e-5)
    np.testing.assert_allclose(pruned_next["hidden"], gated_next["hidden"],
                               rtol=0, atol=1e-5)
    gated_logp, _ = gated_lm.apply(variables, x, gated_mem, method=gated_lm.log_probs)
    pruned_logp, _ = pruned_lm.apply({"params": params}, x, pruned_mem,
                                     method=pruned_lm.log_probs)
    np.testing.assert_allclose(pruned_logp, gated_logp, rtol=0, atol=1e-5)
    gated_mem, pruned_mem = gated_next, pruned_next
  # The gates matter: the same params without them give other outputs.
  ungated_nll, _, _ = gated_lm.apply({"params": variables["params"]}, x, y, gated_mem)
  assert np.abs(ungated_nll - gated_nll).max() > 1e-3


@pytest.mark.parametrize("gate,expected", [
    (HARD, ([0, 2], [], [0, 1, 2, 3])),
    (SOFT, ([0, 2, 3], [], [0, 1, 2, 3])),
], ids=["hard", "soft"])
def test_surviving_heads(gate, expected):
  cfg, variables = gated_model("allatt", gate)
  kept = gate_values.read(cfg, variables["gates"]).surviving_heads
  assert [k.tolist() for k in kept] == list(expected)


@pytest.mark.parametrize("kind", model_lib.KINDS)
def test_exported_tree_is_the_pruned_models(kind):
  cfg, variables = gated_model(kind, HARD)
  pruned_cfg, params = head_removal.remove_heads(cfg, variables)
  assert pruned_cfg.layer_heads == (2, 0, 4) and not pruned_cfg.gated
  assert pruned_cfg.head_dim == cfg.head_dim

  full = variables["params"]["layer_0"]["attention"]
  kept = np.array([0, 2])
  attn = params["layer_0"]["attention"]
  for name in ("query", "key", "value", "rel"):
    assert attn[name]["kernel"].shape == (32, 2, 8)
    np.testing.assert_array_equal(attn[name]["kernel"], full[name]["kernel"][:, kept])
  for name in ("content_bias", "position_bias"):
    np.testing.assert_array_equal(attn[name], full[name][kept])
  if kind == "allatt":
    for name in ("persistent_key", "persistent_value"):
      assert attn[name].shape == (2, 8, 8)
      np.testing.assert_array_equal(attn[name], full[name][kept])
  # Two open heads of four: s_g = 2 is folded into the survivors' W_O.
  assert attn["out"]["kernel"].shape == (2, 8, 32)
  np.testing.assert_allclose(attn["out"]["kernel"], 2.0 * full["out"]["kernel"][kept],
                             rtol=1e-6)

  # The headless layer keeps W_O's bias, which its gated form added with every gate shut.
  headless = {model_lib.HEADLESS_OUT_BIAS}
  assert set(params["layer_1"]) == (
      headless if kind == "allatt" else headless | {"feed_forward", "feed_forward_norm"})
  np.testing.assert_array_equal(params["layer_1"][model_lib.HEADLESS_OUT_BIAS],
                                variables["params"]["layer_1"]["attention"]["out"]["bias"])
  np.testing.assert_array_equal(attn["out"]["bias"], full["out"]["bias"])
  assert params["layer_2"]["attention"]["query"]["kernel"].shape == (32, 4, 8)

  expected = abstract_params(pruned_cfg)
  assert jax.tree.structure(params) == jax.tree.structure(expected)
  assert jax.tree.map(np.shape, params) == jax.tree.map(lambda x: x.shape, expected)
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(params))
  count = sum(x.size for x in jax.tree.leaves(params))
  assert count == cost_model.param_counts(pruned_cfg)["params_total"]

  # Everything outside the attention of pruned layers is copied unchanged.
  flat_full = traverse_util.flatten_dict(variables["params"])
  for path, leaf in traverse_util.flatten_dict(params).items():
    if path[0] != "layer_0" and path[1:] != (model_lib.HEADLESS_OUT_BIAS,):
      np.testing.assert_array_equal(leaf, flat_full[path])


def test_gated_model_with_a_headless_layer_exports():
  cfg, variables = gated_model("allatt", HARD, heads_per_layer=(4, 0, 4))
  assert "layer_1" not in variables["gates"]
  pruned_cfg, params = head_removal.remove_heads(cfg, variables)
  assert pruned_cfg.layer_heads == (2, 0, 4)
  assert jax.tree.structure(params) == jax.tree.structure(abstract_params(pruned_cfg))


def test_variables_without_gates_are_refused():
  cfg, variables = gated_model("allatt")
  with pytest.raises(errors.CheckpointError, match="no head gates, so there is nothing "
                     "to prune. Export needs a pruning run"):
    head_removal.remove_heads(cfg, {"params": variables["params"]})


def test_variables_that_do_not_fit_the_config_are_refused():
  cfg, variables = gated_model("allatt", num_persistent=4)
  wrong_cfg = make_cfg("allatt", num_persistent=8)
  with pytest.raises(errors.CheckpointError,
                     match=r"do not fit the config.*persistent_key: shape \(2, 4, 8\)"):
    head_removal.remove_heads(wrong_cfg, variables)


@pytest.mark.parametrize("open_at_zero,expected", [(True, [0, 1]), (False, [0])])
def test_logit_of_exactly_zero_is_open_as_in_the_official_code(open_at_zero, expected):
  cfg = make_cfg("allatt", run_config.GatesSection(open_at_zero=open_at_zero), num_layers=1)
  gates = {"layer_0": {"attention": {"logits": jnp.array([1.0, 0.0, -1e-6, -2.0])}}}
  assert gate_values.read(cfg, gates).surviving_heads[0].tolist() == expected


@pytest.mark.parametrize("kind", model_lib.KINDS)
def test_a_mask_removes_the_heads_that_indices_remove(kind):
  cfg, variables = gated_model(kind, SOFT)
  ungated = dataclasses.replace(cfg, gated=False)
  params = {"params": variables["params"]}
  mask = (np.array([True, False, True, False]), np.zeros(4, bool), np.ones(4, bool))
  by_mask = head_removal.remove_heads(ungated, params, mask)
  by_index = head_removal.remove_heads(ungated, params, {0: [3, 1], 1: [0, 1, 2, 3]})
  assert by_mask[0] == by_index[0]
  assert by_mask[0].layer_heads == (2, 0, 4) and not by_mask[0].gated
  assert by_mask[0].gate == SOFT   # the model's own gate settings, not the surgery's
  assert jax.tree.structure(by_mask[1]) == jax.tree.structure(by_index[1])
  for a, b in zip(jax.tree.leaves(by_mask[1]), jax.tree.leaves(by_index[1])):
    np.testing.assert_array_equal(a, b)
  # An ungated model's kept heads are copied as they are: no gate value, no scale.
  full = variables["params"]["layer_0"]["attention"]["out"]["kernel"]
  np.testing.assert_array_equal(by_mask[1]["layer_0"]["attention"]["out"]["kernel"],
                                np.asarray(full)[[0, 2]])
  unchanged_cfg, unchanged = head_removal.remove_heads(ungated, params)
  assert unchanged_cfg.layer_heads == (4, 4, 4)
  for a, b in zip(jax.tree.leaves(unchanged), jax.tree.leaves(variables["params"])):
    np.testing.assert_array_equal(a, b)


def test_a_gated_model_loses_its_closed_heads_and_the_chosen_ones():
  cfg, variables = gated_model("allatt", HARD)
  pruned_cfg, params = head_removal.remove_heads(cfg, variables, {2: [1]})
  assert pruned_cfg.layer_heads == (2, 0, 3)
  # Three open heads of four in layer 2: s_g = 4/3 folds into the survivors' W_O.
  full = np.asarray(variables["params"]["layer_2"]["attention"]["out"]["kernel"])
  np.testing.assert_allclose(params["layer_2"]["attention"]["out"]["kernel"],
                             4 / 3 * full[[0, 2, 3]], rtol=1e-6)


@pytest.mark.parametrize("mask, match", [
    ((np.ones(4, bool),) * 2,
     r"one bool array per layer.*\[4, 4, 4\]; got \[bool \(4,\), bool \(4,\)\]"),
    ((np.ones(4, bool), np.ones(3, bool), np.ones(4, bool)), r"bool \(3,\)"),
    ((np.ones(4, np.int32),) * 3, r"got \[int32 \(4,\)"),
])
def test_masks_of_another_shape_are_refused(mask, match):
  cfg = make_cfg("allatt", gated=False)
  _, variables = gated_model("allatt")
  with pytest.raises(errors.ConfigError, match=match):
    head_removal.remove_heads(cfg, {"params": variables["params"]}, mask)


@pytest.mark.parametrize("heads, slots, match", [
    ({3: [0]}, None, r"Layer 3 does not exist: the model has layers 0 \.\. 2\."),
    ({"0": [0]}, None, r"Layer '0' does not exist"),
    ({0: [4]}, None, r"Layer 0 has no head\(s\) \[4\]: its heads are 0 \.\. 3 \(heads "
     r"per layer: \[4, 0, 4\]\)"),
    ({0: [1.0]}, None, r"Layer 0 has no head\(s\) \[1\.0\]"),
    ({1: [0]}, None, r"Layer 1 has no head\(s\) \[0\]: it has no heads left"),
    (None, {0: {1: [8]}}, r"Head 1 of layer 0 has no persistent slot\(s\) \[8\]: its "
     r"slots are 0 \.\. 7\."),
    (None, {0: {1: [0.5]}}, r"Head 1 of layer 0 has no persistent slot\(s\) \[0\.5\]"),
])
def test_heads_and_slots_that_do_not_exist_are_refused_naming_them(heads, slots, match):
  cfg, variables = gated_model("allatt", heads_per_layer=(4, 0, 4))
  with pytest.raises(errors.ConfigError, match=match):
    head_removal.remove_heads(cfg, variables, heads, slots)


def test_an_exports_config_is_the_smaller_model_standing_alone():
  """Its own head counts and relative table, no gates, no init_from and so no teacher:
  a config that loads and trains without the run it came from."""
  config = run_config.RunConfig.of(config_base.load(ROOT / "configs" / "demo.py", "tiny"))
  config = run_config.derived_run(
      config, init_from="/runs/baseline", model=dict(vocab_size=27),
      gates=dict(enabled=True, lam=0.1), distill=dict(weight=0.5, hidden_weight=0.1))
  cfg = model_lib.ModelConfig.from_config(config)
  assert not config.model.max_relative_len   # the run's lengths size the table
  pruned_cfg = dataclasses.replace(cfg, heads_per_layer=(3, 1), gated=False)
  exported = model_export.exported_config(config, pruned_cfg)
  assert (exported.init_from, exported.init_source, exported.gates.enabled) == ("", "", False)
  assert (exported.distill.weight, exported.distill.hidden_weight) == (0.0, 0.0)
  assert exported.model.heads_per_layer == (3, 1)
  assert exported.model.max_relative_len == cfg.max_relative_len > 0
  assert model_lib.ModelConfig.from_config(exported) == dataclasses.replace(
      pruned_cfg, gate=exported.gates)


def test_a_layer_whose_heads_keep_no_persistent_slot_has_no_persistent_arrays():
  cfg, variables = gated_model("allatt")
  pruned_cfg, params = head_removal.remove_heads(
      cfg, variables, slots={2: {h: range(8) for h in range(4)}})
  assert pruned_cfg.persistent_slots == ((8, 8), (), (0, 0, 0, 0))
  assert not any("persistent" in "/".join(path) for path in
                 traverse_util.flatten_dict(params["layer_2"]))


def test_a_txls_export_has_no_persistent_slots_whatever_num_persistent_says():
  cfg, variables = gated_model("txl", num_persistent=8)
  pruned_cfg, _ = head_removal.remove_heads(cfg, variables)
  assert pruned_cfg.layer_heads == (2, 0, 4) and pruned_cfg.persistent_slots is None


def test_only_a_folder_with_params_reads_as_a_model_an_overwrite_may_replace(tmp_path):
  """A run's workdir has a config.json as an export has, but it must read as 'other',
  which not even --overwrite replaces: it holds the checkpoints the export came from."""
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  (run / "config.json").write_text("{}")
  export = tmp_path / "export"
  (export / "params").mkdir(parents=True)
  (export / "config.json").write_text("{}")
  (tmp_path / "empty").mkdir()
  assert model_export.existing_target(tmp_path / "missing") == ""
  assert model_export.existing_target(tmp_path / "empty") == ""
  assert model_export.existing_target(export) == "model"
  assert model_export.existing_target(run) == "other"


@pytest.mark.slow   # saves two models and scores them
def test_a_fixed_lambda_runs_export_warns_only_when_its_gates_closed_no_head(tmp_path):
  """A pruning run's export (`export_pruning_run`) counts the heads its gates keep:
  6 of 12 here, which needs no warning; gates that keep all 12 get one."""
  cfg, variables = gated_model("allatt")
  config, corpus, mesh = helpers.export_scoring(cfg, SEQ_LEN, lam=0.05)
  pruned = model_export.export_pruning_run(tmp_path / "pruned", config, cfg, variables,
                                           corpus, mesh, decision=None,
                                           gate_flags="--config.gates")
  assert pruned["heads_per_layer"] == [2, 0, 4] and pruned["budget"] is None
  assert pruned["warnings"] == []
  all_open = jax.tree.map(jnp.abs, variables["gates"])
  unpruned = model_export.export_pruning_run(
      tmp_path / "unpruned", config, cfg, {**variables, "gates": all_open}, corpus, mesh,
      decision=None, gate_flags="--config.gates")
  assert unpruned["heads_per_layer"] == [4, 4, 4]
  [warning] = unpruned["warnings"]
  assert warning.startswith("pruning removed no head of 12 (λ=0.05)"), warning
