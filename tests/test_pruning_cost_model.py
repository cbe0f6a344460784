"""Cost model: parameter formula vs the real tree, MACs vs XLA, the paper's counts, the
CLI, uniform pruning and a budget's head count."""
import dataclasses
import json
import math
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from allatt_jax.config import config_base
from allatt_jax.config import run_config
from allatt_jax.config.errors import ConfigError
from allatt_jax.pruning import cost_model
from allatt_jax.model import transformer as model_lib
from allatt_jax.training import assembly

ROOT = pathlib.Path(__file__).resolve().parents[1]


def small_cfg(kind, heads_per_layer=None):
  # A TXL has no persistent vectors, whatever num_persistent says.
  return model_lib.ModelConfig(
      kind=kind, vocab_size=64, num_layers=3, d_model=128, num_heads=4,
      heads_per_layer=heads_per_layer, num_persistent=128,
      d_ff=512 if kind == "txl" else 0, max_relative_len=64)


def paper_cfg(name, arg=None):
  return model_lib.ModelConfig.from_config(config_base.load(ROOT / "configs" / name, arg))


@pytest.mark.parametrize("kind", ["allatt", "txl"])
@pytest.mark.parametrize("heads", [None, (4, 0, 3)])
@pytest.mark.parametrize("official", [True, False])
def test_layer_formula_equals_parameter_tree(kind, heads, official):
  cfg = dataclasses.replace(small_cfg(kind, heads), out_bias=official,
                            final_norm=not official)
  abstract = jax.eval_shape(
      model_lib.TransformerLM(cfg).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32),
      jnp.zeros((1, 1), jnp.int32), model_lib.init_memory(cfg, 1, 1))
  params = nn.unbox(abstract["params"])
  for i, h in enumerate(cfg.layer_heads):
    tree = params.get(f"layer_{i}", {})
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
    assert count == cost_model.layer_param_count(cfg, h), (i, h)
  counts = cost_model.param_counts(cfg)
  assert counts["params_non_embedding"] == (
      sum(cost_model.layer_param_count(cfg, h) for h in cfg.layer_heads)
      + (2 * cfg.d_model if cfg.final_norm else 0))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["allatt", "txl"])
def test_macs_formula_matches_xla_cost_analysis(kind):
  cfg = small_cfg(kind, (4, 2, 3))
  b, t, s = 4, 32, 32
  lm = model_lib.TransformerLM(cfg)
  memory = model_lib.init_memory(cfg, b, s)
  x = jnp.zeros((b, t), jnp.int32)
  variables = nn.unbox(lm.init(jax.random.key(0), x, x, memory))
  forward = jax.jit(lambda v, x, m: lm.apply(v, x, x, m)[0])
  analysis = forward.lower(variables, x, memory).compile().cost_analysis()
  if isinstance(analysis, list):   # older jax returns one dict per device
    analysis = analysis[0]
  formula_flops = 2 * cost_model.macs_per_token(cfg, t, s, b)["macs_per_token"] * b * t
  # XLA also counts elementwise work (softmax, LayerNorm) that the formula leaves out.
  assert 1.0 <= analysis["flops"] / formula_flops < 1.06


def test_paper_parameter_counts():
  wt103 = cost_model.param_counts(paper_cfg("wt103_base.py"))
  text8 = cost_model.param_counts(paper_cfg("text8_base.py"))
  assert round(wt103["params_non_embedding"] / 1e6, 1) == 54.6   # Table 1
  assert round(text8["params_non_embedding"] / 1e6, 1) == 40.9   # Table 2
  assert round(wt103["params_embedding"] / 1e6, 1) == 19.5       # paper: 19.6M


def test_head_pruning_shrinks_allatt_proportionally_but_not_txl():
  """Fig. 1: at 50% heads, TXL keeps ~81% params / ~73% MACs, All-att 50% / 50%."""
  allatt = cost_model.report(paper_cfg("wt103_base.py"), 192, 192, 96, heads_kept=0.5)
  txl = cost_model.report(paper_cfg("txl_wt103_base.py"), 192, 192, 96, heads_kept=0.5)
  assert allatt["relative_params"] == pytest.approx(0.5, abs=0.001)
  assert allatt["relative_macs"] == pytest.approx(0.5, abs=0.001)
  assert txl["relative_params"] == pytest.approx(0.81, abs=0.01)
  assert txl["relative_macs"] == pytest.approx(0.73, abs=0.02)


@pytest.mark.slow
def test_cli_prints_one_json_object():
  out = subprocess.run(
      [sys.executable, "-m", "allatt_jax.costs", "--config=configs/wt103_base.py:tiny",
       "--heads_kept=0.5"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
  report = json.loads(out)
  for key in ("params_non_embedding", "params_embedding", "params_total", "macs_per_token",
              "relative_params", "relative_macs"):
    assert key in report
  assert report["heads_per_layer"] == [2, 2]


def test_a_pruning_config_without_init_from_has_costs(tmp_path):
  # Costs build the model without training it: its vocabulary comes from the dataset,
  # and what a run would start from is not asked for.
  config = config_base.load(ROOT / "configs" / "demo.py", "tiny")
  config.gates.update(dict(enabled=True, freeze_step=10))
  config.data.data_dir = str(tmp_path / "tfds")
  assert not config.init_from and not config.model.vocab_size
  assert assembly.with_vocab_size(config).model.vocab_size == 27


def test_uniform_pruning_keeps_the_nearest_head_count_of_every_layer():
  cfg = small_cfg("allatt", (8, 8, 8))
  assert cost_model.prune_uniformly(cfg, 0.7).layer_heads == (6, 6, 6)   # 5.6
  assert cost_model.prune_uniformly(cfg, 0.3).layer_heads == (2, 2, 2)   # 2.4
  # An export's heads keep their own persistent slots, most first.
  export = dataclasses.replace(cfg, heads_per_layer=(3, 2, 1),
                               persistent_slots=((128, 64, 32), (128, 8), (16,)))
  pruned = cost_model.prune_uniformly(export, 0.7)
  assert pruned.layer_heads == (2, 1, 1)
  assert pruned.persistent_slots == ((128, 64), (128,), (16,))
  for bad in (-0.1, 1.5):
    with pytest.raises(ValueError, match=rf"--heads_kept must lie in \[0, 1\], got {bad}"):
      cost_model.prune_uniformly(cfg, bad)


def _budget_run(**gates):
  """configs/demo.py:tiny (2 layers of 4 heads) as a pruning run with `gates`; eval rows
  of 3, so that a head's MACs per token are a fraction (K / (B·T) of its relative
  projection)."""
  config = config_base.load(ROOT / "configs" / "demo.py", "tiny")
  config.model.vocab_size = 27
  config.eval.batch_size = 3
  config.gates.update(dict(enabled=True, freeze_step=20, **gates))
  return run_config.RunConfig.of(config)


@pytest.mark.parametrize("key", ["target_params", "target_macs"])
def test_a_size_budget_keeps_the_most_heads_that_fit(key):
  run = _budget_run(**{key: 1.0})
  scale = cost_model.BudgetScale.of(run, model_lib.ModelConfig.from_config(run))
  assert scale.per_head != int(scale.per_head) or key == "target_params"
  for heads in range(1, 9):
    # A model's own cost keeps it; a little less does not.
    assert scale.heads(scale.measure(heads)) == heads
    assert scale.heads(scale.measure(heads) - 0.01) == heads - 1
  # More than the unpruned model costs keeps every head.
  assert scale.heads(10 * scale.full) == 8


def test_a_sparsity_keeps_the_nearest_head_count_and_a_size_must_be_positive():
  run = _budget_run(target_sparsity=0.3)   # 70% of 8 heads: 5.6
  cfg = model_lib.ModelConfig.from_config(run)
  assert cost_model.target_open_heads(run, cfg) == 6
  with pytest.raises(ConfigError, match=r"config.gates.target_macs=0.0 must be positive"):
    cost_model.target_open_heads(_budget_run(target_macs=0.0), cfg)


@pytest.mark.parametrize("key", ["target_params", "target_macs"])
def test_a_budget_measures_the_attention_layers_whatever_the_output_layer(key):
  plain = _budget_run(**{key: 1.0})
  adaptive = run_config.derived_run(plain, model=dict(cutoffs=(10, 20), div_val=2))
  costs = [cost_model.unpruned_cost(run, model_lib.ModelConfig.from_config(run))
           for run in (plain, adaptive)]
  assert costs[0] == costs[1] > 0


def test_the_every_tail_count_is_given_only_where_capacities_make_it_differ():
  cfg = small_cfg("allatt")
  assert "macs_per_token_every_tail" not in cost_model.macs_per_token(cfg, 32, 32, 4)
  adaptive = dataclasses.replace(cfg, vocab_size=256, cutoffs=(24, 96), div_val=2,
                                 tail_capacity=2.0)
  macs = cost_model.macs_per_token(adaptive, 32, 32, 4)
  assert macs["macs_per_token_every_tail"] > macs["macs_per_token"]
