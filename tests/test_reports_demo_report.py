"""The demo's report from what its stages return: the figures it derives (sparsities,
speed-up, MAC ratios, the budget met) and its summary table."""
import pathlib

import pytest

from helpers import measured_speeds
from allatt_jax.config import config_base
from allatt_jax.config import run_config
from allatt_jax.reports import demo_report

BASELINE = {"heads_per_layer": [4, 4], "persistent_per_layer": [32, 32],
            "params_non_embedding": 1000, "macs_per_token_non_embedding": 4000,
            "macs_per_token": 10000}
# 3 heads kept of 8; 8 slots of 24 kept with them (16 more closed as groups).
PRUNED = {"heads_per_layer": [1, 2], "persistent_per_layer": [8, 8],
          "params_non_embedding": 500, "macs_per_token_non_embedding": 1000,
          "macs_per_token": 7000}
SPEED = measured_speeds(200.0, 300.0)


def report(**gates):
  config = config_base.base_config()
  config.gates.update(dict(enabled=True, persistent_group=4, **gates))
  prune_config = run_config.RunConfig.of(config)
  baseline = {"metric": "bpc", "valid": 2.0, "test": 1.9}
  budget = {"allowed": 3, "groups": 4} if prune_config.gates.budget_target else None
  pruned = {"valid": 2.25, "test": 2.15,
            "export": {"valid": 2.2, "test": 2.1, "budget": budget, "warnings": ["w"]}}
  compared = {"baseline": BASELINE, "pruned": PRUNED, "speed": SPEED}
  return demo_report.build(run_config.RunConfig.of(config_base.base_config()),
                           prune_config, pathlib.Path("/runs/demo/pruned-2"), baseline,
                           pruned, compared)


def test_a_budget_runs_report_derives_its_figures():
  built = report(target_params=600.0)
  pruned, speed = built["pruned"], built["speed"]
  assert pruned["directory"] == "pruned-2"
  # The exported model's scores; the gated model's beside them.
  assert (pruned["valid"], pruned["test"]) == (2.2, 2.1)
  assert (pruned["gated_valid"], pruned["gated_test"]) == (2.25, 2.15)
  assert pruned["sparsity"] == pytest.approx(5 / 8)
  assert pruned["persistent_sparsity"] == pytest.approx(48 / 64)
  assert pruned["lambda"] is None
  assert pruned["budget"] == {"key": "target_params", "asked": 600.0, "value": 600.0,
                              "unpruned": 1000, "cost": 500, "step": None, "allowed": 3,
                              "by_gates": None, "groups": 4, "groups_by_gates": None,
                              "changed": None, "opened": None, "closed": None}
  assert speed["speedup"] == pytest.approx(1.5)
  assert speed["macs_ratio"] == pytest.approx(0.7)
  assert speed["macs_ratio_non_embedding"] == pytest.approx(0.25)
  # The input and output layers take 6,000 of the pruned model's 7,000 MACs.
  assert built["warnings"] == ["w", (
      "the input and output layers, which pruning heads leaves as they are, take 6,000 "
      "of the pruned model's 7,000 MACs per token (86%). So the layers' MACs went to "
      "0.25 of the baseline's but the whole model's to 0.70, and it runs 1.50x as fast. "
      "A smaller vocabulary makes it faster: --config.data.max_vocab, or at word level "
      "--config.data.min_count.")]

  macs = report(target_macs=2000.0)["pruned"]["budget"]
  assert (macs["unpruned"], macs["cost"]) == (4000, 1000)
  fixed = report(lam=0.03)["pruned"]
  assert fixed["lambda"] == 0.03 and fixed["budget"] is None


def test_no_warning_where_the_layers_hold_most_of_the_macs(monkeypatch):
  # 3,000 of 7,000 MACs outside the layers: under half, no warning.
  monkeypatch.setitem(PRUNED, "macs_per_token_non_embedding", 4000)
  assert report(target_params=600.0)["warnings"] == ["w"]
  # Exactly half: the warning.
  monkeypatch.setitem(PRUNED, "macs_per_token_non_embedding", 3500)
  assert len(report(target_params=600.0)["warnings"]) == 2


def table_rows(text):
  title, _, _, *rows = text.splitlines()
  return title, {row.split("|")[0].strip(): [c.strip() for c in row.split("|")[1:]]
                 for row in rows}


def test_the_table_shows_each_size_as_a_share_and_closed_groups_only_when_there_are():
  title, rows = table_rows(demo_report.summary_table(report(target_params=600.0)))
  assert title == ("wikitext_chars: speed-up 1.50x (middle half of 3 rounds: 1.50-1.50; "
                   "CPU time: 1.50x)")
  assert rows["inference tokens/s"] == ["200", "300"]
  assert rows["CPU µs per token"] == ["5,000.0", "3,333.3"]
  assert rows["params (non-emb.)"] == ["1,000", "500 (0.50)"]
  assert rows["MACs/token (non-emb.)"] == ["4,000", "1,000 (0.25)"]
  assert rows["MACs per token"] == ["1.00", "0.70"]
  assert rows["head sparsity"] == ["0%", "62.5%"]
  assert rows["persistent vectors"] == ["32 32", "8 8"]
  assert rows["budget target_params"] == ["", "600"]

  # Slots that left only with their heads (8 a head): no row of their own.
  unchanged = report(lam=0.03)
  unchanged["pruned"]["persistent_per_layer"] = [8, 16]
  _, rows = table_rows(demo_report.summary_table(unchanged))
  assert "persistent vectors" not in rows and rows["params (non-emb.)"] == ["1,000", "500"]


def test_the_speed_up_line_says_when_the_machine_was_busy_and_shows_the_spread():
  built = report(lam=0.03)
  built["speed"].update(measured_speeds(200.0, 300.0, rounds=5, busy=True))
  built["speed"].update(speedup=1.48, speedup_quartiles=[1.41, 1.52], cpu_speedup=1.5)
  assert demo_report.summary_table(built).splitlines()[0] == (
      "wikitext_chars: speed-up 1.48x (middle half of 5 rounds: 1.41-1.52; CPU time: "
      "1.50x), timed on a busy machine: other processes used 0.9 of its 2 cores")
