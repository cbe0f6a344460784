"""The run config's one schema: its defaults, and the one reader of a run's keys."""
import dataclasses
import json
from collections.abc import Mapping

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from allatt_jax.config import config_base
from allatt_jax.config import typed_section
from allatt_jax.model import transformer as model_lib
from allatt_jax.runs import run_files
from allatt_jax.training import config_checks
from allatt_jax.config.errors import CheckpointError
from allatt_jax.config.errors import ConfigError
from allatt_jax.config.run_config import RunConfig


def test_the_config_files_start_from_the_sections_defaults():
  assert RunConfig.of(config_base.base_config()) == RunConfig()
  # The model a run builds has no defaults of its own: an unset key reads as the section's.
  cfg = model_lib.ModelConfig.from_config(RunConfig())
  assert (cfg.vocab_size, cfg.dropout, cfg.dropout_attn) == (0, 0.1, 0.2)
  assert cfg.gate == RunConfig().gates


def test_a_key_whose_default_is_none_can_be_set():
  config = config_base.base_config()
  config.gates.target_macs = 5e5
  config.model.heads_per_layer = (2, 3)
  run = RunConfig.of(config)
  assert (run.gates.target_macs, run.model.heads_per_layer) == (5e5, (2, 3))


@pytest.mark.parametrize("section, key, value, message", [
    ("model", "num_head", 4, "Unknown key --config.model.num_head; known: kind,"),
    ("gates", "lam", "high", "--config.gates.lam is 'high'; it takes float."),
    ("train", "num_steps", 1.5, "--config.train.num_steps is 1.5; it takes int."),
    ("train", "learning_rate", True, "--config.train.learning_rate is True; it takes float."),
])
def test_a_key_or_value_the_schema_lacks_is_refused(section, key, value, message):
  values = config_base.base_config().to_dict()
  values[section][key] = value
  with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
    RunConfig.from_dict(values)


@dataclasses.dataclass(frozen=True)
class _Suite:
  """A section of the kinds the reader's tuples and mappings take (an experiment plan's)."""
  budgets: tuple[tuple[str, float], ...] = ()
  rates: Mapping[str, float] = dataclasses.field(default_factory=dict)


def test_the_reader_types_each_element_of_a_tuple_and_each_value_of_a_mapping():
  suite = typed_section.read(_Suite, {"budgets": [["target_params", 5]], "rates": {"lr": 1}},
                             "--config.suite")
  assert suite.budgets == (("target_params", 5.0),) and type(suite.budgets[0][1]) is float
  assert dict(suite.rates) == {"lr": 1.0} and type(suite.rates["lr"]) is float
  with pytest.raises(ConfigError, match=r"^--config\.suite\.rates is \{'lr': 'fast'\}; it "
                     r"takes a dict\.$"):
    typed_section.read(_Suite, {"rates": {"lr": "fast"}}, "--config.suite")


def test_a_model_config_built_by_hand_with_lists_holds_tuples_and_traces():
  by_hand = model_lib.ModelConfig(vocab_size=11, num_layers=2, d_model=16, num_heads=4,
                                  num_persistent=2, heads_per_layer=[4, 2],
                                  persistent_slots=[[2, 2, 2, 1], [2, 0]],
                                  max_relative_len=4)
  as_read = dataclasses.replace(by_hand, heads_per_layer=(4, 2),
                                persistent_slots=((2, 2, 2, 1), (2, 0)))
  assert by_hand == as_read and hash(by_hand) == hash(as_read)
  assert by_hand.persistent_slots == ((2, 2, 2, 1), (2, 0))
  shapes = flax.linen.unbox(model_lib.abstract_variables(by_hand))["params"]
  # Layer 1's two heads keep 2 and 0 slots: stored padded to its most, 2.
  assert shapes["layer_1"]["attention"]["persistent_key"].shape == (2, 2, 4)


def test_the_relative_table_spans_the_longest_train_or_eval_context():
  config = config_base.base_config()
  config.train.update(dict(seq_len=16, mem_len=16))
  config.eval.update(dict(seq_len=32, mem_len=24))
  assert RunConfig.of(config).relative_table_len == 56
  config.eval.update(dict(seq_len=8, mem_len=8))
  assert RunConfig.of(config).relative_table_len == 32
  config.model.max_relative_len = 40     # set: as it is
  assert RunConfig.of(config).relative_table_len == 40


def test_a_saved_config_with_an_unknown_key_is_refused_naming_the_file(tmp_path):
  saved = RunConfig().to_dict()
  saved["model"]["num_head"] = 4
  (tmp_path / run_files.CONFIG_FILE).write_text(json.dumps(saved))
  with pytest.raises(CheckpointError, match=r"config\.json does not read as a run's config: "
                     r"Unknown key config\.model\.num_head"):
    run_files.load_config(tmp_path)
  del saved["model"]["num_head"], saved["distill"]
  (tmp_path / run_files.CONFIG_FILE).write_text(json.dumps(saved))
  assert run_files.load_config(tmp_path) == RunConfig()   # a section it predates: defaults


def test_a_saved_model_of_the_removed_whole_core_kernels_reads_as_the_xla_core(tmp_path):
  """A run or export saved with attention_impl='pallas' (the fused kernels, since
  removed, computed the XLA core's numbers) loads, passes the checks of a run started
  from it, and computes."""
  config = config_base.base_config()
  config.model.update(dict(vocab_size=11, num_persistent=4))
  saved = RunConfig.of(config).to_dict()
  saved["model"]["attention_impl"] = "pallas"
  (tmp_path / run_files.CONFIG_FILE).write_text(json.dumps(saved))
  loaded = run_files.load_config(tmp_path)
  assert loaded == RunConfig.from_dict({**saved, "model": {**saved["model"],
                                                           "attention_impl": "xla"}})
  config_checks.check_config(loaded, 1)
  lm = model_lib.TransformerLM.from_config(loaded)
  tokens = jnp.zeros((1, 4), jnp.int32)
  memory = model_lib.init_memory(lm.cfg, 1, 3)
  variables = jax.jit(lm.init)(jax.random.key(0), tokens, tokens, memory)
  assert np.all(np.isfinite(jax.jit(lm.apply)(variables, tokens, tokens, memory)[0]))
