"""The demo's report: both models' scores, sizes and inference speeds, and the summary
table the demo prints (and the README quotes).

`compare_models` sets both models side by side: their sizes and costs, and their
speeds, timed in turns on the same tokens; `build` gathers that and what
the stages returned into report.json's content; `summary_table` renders it.
"""
from collections.abc import Callable

import jax

from allatt_jax.pruning import cost_model
from allatt_jax.evaluation import speed
from allatt_jax.config.run_config import RunConfig
from allatt_jax.runs.trained_model import LoadedModel

# Where the input and output layers, which pruning heads leaves as they are, take at
# least this share of the pruned model's MACs per token, the report says why the
# speed-up stays small.
OUTER_LAYERS_SHARE_TO_WARN = 0.5


def compare_models(config: RunConfig, mesh: jax.sharding.Mesh, tokens, num_batches,
                   baseline_model: LoadedModel, pruned_model: LoadedModel,
                   safe_point: Callable[[], None] = lambda: None) -> dict:
  """What the report says of both models themselves, under 'baseline' and 'pruned':
  heads and persistent vectors per layer and costs at the baseline's eval lengths
  (cost_model); and under 'speed' their inference speeds (`speed.tokens_per_s`, which
  calls `safe_point` between its compiles and timed runs)."""
  speeds = speed.tokens_per_s(config, mesh, tokens, num_batches,
                              {"baseline": baseline_model, "pruned": pruned_model},
                              safe_point=safe_point)
  t = config.eval
  compared = {name: {"heads_per_layer": list(lm.cfg.layer_heads),
                     "persistent_per_layer": lm.cfg.layer_slots,
                     **cost_model.param_counts(lm.cfg),
                     **cost_model.macs_per_token(lm.cfg, t.seq_len, t.mem_len,
                                                 t.batch_size)}
              for name, lm in (("baseline", baseline_model.lm), ("pruned", pruned_model.lm))}
  return {**compared, "speed": speeds}


def build(baseline_config: RunConfig, prune_config: RunConfig, pruned_dir, baseline: dict,
          pruned: dict, compared: dict) -> dict:
  """report.json's content: the stages' results (`loop.train_and_evaluate`'s),
  both models as `compare_models` describes them, the pruning goal and the budget's
  decision."""
  b, p, speeds = compared["baseline"], compared["pruned"], compared["speed"]
  budget = _budget(prune_config.gates, pruned["export"].get("budget"), b, p)
  speedup = speed.speedup(speeds)
  return {
      "dataset": baseline_config.data.name,
      "metric": baseline["metric"],
      "baseline": {
          "valid": baseline["valid"], "test": baseline["test"],
          "params_non_embedding": b["params_non_embedding"],
          "macs_per_token_non_embedding": b["macs_per_token_non_embedding"],
          "heads_per_layer": b["heads_per_layer"],
          "persistent_per_layer": b["persistent_per_layer"]},
      "pruned": {
          "directory": pruned_dir.name,     # beside report.json: 'pruned' or 'pruned-N'
          "valid": pruned["export"]["valid"], "test": pruned["export"]["test"],
          "gated_valid": pruned["valid"], "gated_test": pruned["test"],
          "params_non_embedding": p["params_non_embedding"],
          "macs_per_token_non_embedding": p["macs_per_token_non_embedding"],
          "heads_per_layer": p["heads_per_layer"],
          "sparsity": 1.0 - sum(p["heads_per_layer"]) / sum(b["heads_per_layer"]),
          # Persistent slots kept per layer (summed over its heads), and the fraction
          # of all removed (with their heads, or as closed persistent groups).
          "persistent_per_layer": p["persistent_per_layer"],
          "persistent_sparsity": (
              1.0 - sum(p["persistent_per_layer"]) / sum(b["persistent_per_layer"])
              if sum(b["persistent_per_layer"]) else 0.0),
          # A fixed λ, or the budget (`_budget`).
          "lambda": None if budget else prune_config.gates.lam,
          "budget": budget},
      "speed": {
          **speeds,
          **speedup,
          "macs_ratio": p["macs_per_token"] / b["macs_per_token"],
          "macs_ratio_non_embedding": (p["macs_per_token_non_embedding"]
                                       / b["macs_per_token_non_embedding"])},
      "warnings": [*pruned["export"].get("warnings", []),
                   *_outer_layers_bound(b, p, speedup["speedup"])],
  }


def _outer_layers_bound(b: dict, p: dict, speedup: float) -> list[str]:
  """A warning where the input and output layers hold most of the pruned model's MACs
  per token (a large vocabulary): pruning heads shrinks only the rest."""
  outer = p["macs_per_token"] - p["macs_per_token_non_embedding"]
  if outer < OUTER_LAYERS_SHARE_TO_WARN * p["macs_per_token"]:
    return []
  return [f"the input and output layers, which pruning heads leaves as they are, take "
          f"{outer:,.0f} of the pruned model's {p['macs_per_token']:,.0f} MACs per token "
          f"({outer / p['macs_per_token']:.0%}). So the layers' MACs went to "
          f"{p['macs_per_token_non_embedding'] / b['macs_per_token_non_embedding']:.2f} of "
          f"the baseline's but the whole model's to "
          f"{p['macs_per_token'] / b['macs_per_token']:.2f}, and it runs {speedup:.2f}x as "
          "fast. A smaller vocabulary makes it faster: --config.data.max_vocab, or at word "
          "level --config.data.min_count."]


def _budget(gates, decision: dict | None, b: dict, p: dict) -> dict | None:
  """report.json's 'budget' block, the same keys for every budget run (None without
  a budget): 'key'; 'asked', as given (a fraction of the unpruned model, or a
  figure); 'value', the figure it stands for; 'unpruned' and 'cost', what it measures
  of both models (a sparsity: 0 and the sparsity met); and of the decision at the
  freeze (`freeze.keep_budgeted`) 'step', the heads kept ('allowed') and kept by the
  gates alone ('by_gates'), the same of persistent groups ('groups',
  'groups_by_gates': None without group gates), and the decisions the budget
  reversed ('changed', 'opened', 'closed')."""
  key = gates.budget_target
  if key is None:
    return None
  value = getattr(gates, key)
  if key == "target_sparsity":
    measured = (0.0, 1.0 - sum(p["heads_per_layer"]) / sum(b["heads_per_layer"]))
  else:
    name = ("params_non_embedding" if key == "target_params"
            else "macs_per_token_non_embedding")
    measured = (b[name], p[name])
  decision = decision or {}
  asked = value if gates.budget_fraction is None else gates.budget_fraction
  return {"key": key, "asked": asked, "value": value, "unpruned": measured[0],
          "cost": measured[1],
          **{k: decision.get(k) for k in ("step", "allowed", "by_gates", "groups",
                                           "groups_by_gates", "changed", "opened",
                                           "closed")}}


def _groups_pruned(report: dict) -> bool:
  """Whether the pruned model lost persistent vectors beyond those of its removed
  heads (else the table's head rows say it all, as they did before such gates)."""
  b, p = report["baseline"], report["pruned"]
  per_head = [n // h if h else 0 for n, h in zip(b["persistent_per_layer"],
                                                 b["heads_per_layer"])]
  return any(n != h * k for n, h, k in zip(p.get("persistent_per_layer", []),
                                           p["heads_per_layer"], per_head))


def _budget_value(budget: dict) -> str:
  """The budget asked for, as the table shows it: a sparsity and the heads it keeps,
  a size in full, or the fraction asked beside it."""
  if budget["key"] == "target_sparsity":
    return f"{budget['value']:g} ({budget['allowed']} heads)"
  asked = budget.get("asked", budget["value"])
  if asked == budget["value"]:
    return f"{budget['value']:,.0f}"
  return f"{asked:g} ({budget['value']:,.0f})"


def summary_table(report: dict) -> str:
  """The table the demo prints. A budget run's adds the budget, and each size its
  share of the unpruned model's (params; MACs of the layers, which pruning shrinks,
  below the ratio with the input and output layers)."""
  metric, b, p, s = report["metric"], report["baseline"], report["pruned"], report["speed"]
  budget = p.get("budget")
  share = lambda key: f" ({p[key] / b[key]:.2f})" if budget else ""
  rows = [
      ("", "baseline", "pruned"),
      (f"valid {metric}", f"{b['valid']:.4f}", f"{p['valid']:.4f}"),
      (f"test {metric}", f"{b['test']:.4f}", f"{p['test']:.4f}"),
      ("params (non-emb.)", f"{b['params_non_embedding']:,}",
       f"{p['params_non_embedding']:,}{share('params_non_embedding')}"),
      ("heads per layer", " ".join(map(str, b["heads_per_layer"])),
       " ".join(map(str, p["heads_per_layer"]))),
      ("head sparsity", "0%", f"{100 * p['sparsity']:.1f}%"),
      *([("persistent vectors", " ".join(map(str, b["persistent_per_layer"])),
          " ".join(map(str, p["persistent_per_layer"])))]
        if _groups_pruned(report) else []),
      ("inference tokens/s", f"{s['baseline_tokens_per_s']:,.0f}",
       f"{s['pruned_tokens_per_s']:,.0f}"),
      *([("CPU µs per token", f"{s['baseline_cpu_us_per_token']:,.1f}",
          f"{s['pruned_cpu_us_per_token']:,.1f}")] if "rounds" in s else []),
      ("MACs per token", "1.00", f"{s['macs_ratio']:.2f}"),
      *([("MACs/token (non-emb.)", f"{b['macs_per_token_non_embedding']:,.0f}",
          f"{p['macs_per_token_non_embedding']:,.0f}"
          f"{share('macs_per_token_non_embedding')}"),
         (f"budget {budget['key']}", "", _budget_value(budget))] if budget else []),
  ]
  widths = [max(len(r[i]) for r in rows) for i in range(3)]
  lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
  lines.insert(1, "-+-".join("-" * w for w in widths))
  return f"{report['dataset']}: {speedup_line(s)}\n" + "\n".join(lines)


def speedup_line(s: dict) -> str:
  """'speed-up 1.70x (middle half of 30 rounds: 1.57-1.90; CPU time: 1.66x)': the
  speed-up of report.json's 'speed', its spread over the rounds, the same in CPU time
  per token, and whether the machine was busy (`speed.tokens_per_s`)."""
  if "rounds" not in s:    # a report written before the rounds: one figure
    return f"speed-up {s['speedup']:.2f}x"
  low, high = s["speedup_quartiles"]
  line = (f"speed-up {s['speedup']:.2f}x (middle half of {s['rounds']} rounds: "
          f"{low:.2f}-{high:.2f}; CPU time: {s['cpu_speedup']:.2f}x)")
  machine = s["machine"]
  if machine["busy"]:
    line += (f", timed on a busy machine: other processes used {machine['other_cores']:.1f}"
             f" of its {machine['cores']} cores")
  return line

