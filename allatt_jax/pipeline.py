"""Baseline → pruning → export → comparison, as one command (configs/demo.py).

The config describes the baseline run; its `pipeline` section lists what the pruning
run changes (`prune_train`, `prune_gates`). Each stage is an ordinary run in its own
subfolder of the workdir, so a rerun resumes whatever was not finished.

Writes WORKDIR/report.json and WORKDIR/gates.png, and prints a summary table.
"""
import json

from etils import epath
import jax
import matplotlib
import ml_collections
import numpy as np

from allatt_jax import checkpointing
from allatt_jax import costs
from allatt_jax import evaluate
from allatt_jax import model as model_lib
from allatt_jax import train

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top


def stage_configs(config: ml_collections.ConfigDict, workdir: epath.Path):
  """(baseline config, pruning config) of a pipeline config."""
  baseline = config.copy_and_resolve_references()
  with baseline.unlocked():
    del baseline["pipeline"]
  prune = baseline.copy_and_resolve_references()
  prune.train.update(config.pipeline.prune_train.to_dict())
  prune.gates.update(config.pipeline.prune_gates.to_dict())
  prune.init_from = str(workdir / "baseline")
  return baseline, prune


def run(config: ml_collections.ConfigDict, workdir) -> dict:
  workdir = checkpointing.run_path(workdir)
  baseline_config, prune_config = stage_configs(config, workdir)
  baseline = train.train_and_evaluate(baseline_config, workdir / "baseline")
  pruned = train.train_and_evaluate(prune_config, workdir / "pruned")

  baseline_model = _load(workdir / "baseline")
  pruned_model = _load(pruned["export"]["directory"])
  speed = _measure_speed(baseline_config, config.pipeline.speed_batches, baseline_model,
                         pruned_model)
  report = _report(config, baseline, pruned, baseline_model, pruned_model, speed)
  if jax.process_index() == 0:
    (workdir / "report.json").write_text(json.dumps(report, indent=2))
    plot_gates(workdir / "pruned" / train.GATE_HISTORY_FILE, workdir / "gates.png",
               prune_config.gates.freeze_step)
    print(summary_table(report))
  return report


def _load(directory):
  config, variables = checkpointing.load_model(directory)
  return model_lib.TransformerLM(model_lib.model_config(config)), variables


def _measure_speed(config, num_batches, baseline_model, pruned_model,
                   repeats: int = 3) -> dict:
  """Inference tokens/s (evaluation with memory) of both models on the valid split.

  The models are timed in turns, `repeats` times each, and each keeps its best: on a
  shared machine the best of alternating runs is the least disturbed comparison.
  """
  run = train.Run(config)
  tokens, e = run.corpus.splits["valid"], config.eval
  evaluators = {}
  for name, (lm, variables) in (("baseline", baseline_model), ("pruned", pruned_model)):
    evaluators[name] = (evaluate.Evaluator(lm, run.mesh, batch_size=e.batch_size,
                                           seq_len=e.seq_len, mem_len=e.mem_len), variables)
    evaluators[name][0].score(variables, tokens, max_batches=1)   # compile, untimed
  speeds = {f"{name}_tokens_per_s": 0.0 for name in evaluators}
  for _ in range(repeats):
    for name, (evaluator, variables) in evaluators.items():
      scored = evaluator.score(variables, tokens, max_batches=num_batches)
      speeds[f"{name}_tokens_per_s"] = max(speeds[f"{name}_tokens_per_s"],
                                           scored["tokens_per_s"])
  return speeds


def _report(config, baseline, pruned, baseline_model, pruned_model, speed) -> dict:
  t = config.eval
  cost = {name: {**costs.param_counts(lm.cfg),
                 **costs.macs_per_token(lm.cfg, t.seq_len, t.mem_len, t.batch_size)}
          for name, (lm, _) in (("baseline", baseline_model), ("pruned", pruned_model))}
  full_heads = sum(baseline_model[0].cfg.layer_heads)
  pruned_heads = list(pruned_model[0].cfg.layer_heads)
  return {
      "dataset": config.data.name,
      "metric": baseline["metric"],
      "baseline": {
          "valid": baseline["valid"], "test": baseline["test"],
          "params_non_embedding": cost["baseline"]["params_non_embedding"],
          "heads_per_layer": list(baseline_model[0].cfg.layer_heads)},
      "pruned": {
          "valid": pruned["export"]["valid"], "test": pruned["export"]["test"],
          "gated_valid": pruned["valid"], "gated_test": pruned["test"],
          "params_non_embedding": cost["pruned"]["params_non_embedding"],
          "heads_per_layer": pruned_heads,
          "sparsity": 1.0 - sum(pruned_heads) / full_heads,
          "lambda": config.pipeline.prune_gates.lam},
      "speed": {
          **speed,
          "speedup": speed["pruned_tokens_per_s"] / speed["baseline_tokens_per_s"],
          "macs_ratio": (cost["pruned"]["macs_per_token"]
                         / cost["baseline"]["macs_per_token"]),
          "macs_ratio_non_embedding": (cost["pruned"]["macs_per_token_non_embedding"]
                                       / cost["baseline"]["macs_per_token_non_embedding"])},
  }


def summary_table(report: dict) -> str:
  metric, b, p, s = report["metric"], report["baseline"], report["pruned"], report["speed"]
  rows = [
      ("", "baseline", "pruned"),
      (f"valid {metric}", f"{b['valid']:.4f}", f"{p['valid']:.4f}"),
      (f"test {metric}", f"{b['test']:.4f}", f"{p['test']:.4f}"),
      ("params (non-emb.)", f"{b['params_non_embedding']:,}", f"{p['params_non_embedding']:,}"),
      ("heads per layer", " ".join(map(str, b["heads_per_layer"])),
       " ".join(map(str, p["heads_per_layer"]))),
      ("head sparsity", "0%", f"{100 * p['sparsity']:.1f}%"),
      ("inference tokens/s", f"{s['baseline_tokens_per_s']:,.0f}",
       f"{s['pruned_tokens_per_s']:,.0f}"),
      ("MACs per token", "1.00", f"{s['macs_ratio']:.2f}"),
  ]
  widths = [max(len(r[i]) for r in rows) for i in range(3)]
  lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
  lines.insert(1, "-+-".join("-" * w for w in widths))
  return f"{report['dataset']}: speed-up {s['speedup']:.2f}x\n" + "\n".join(lines)


def plot_gates(history_file, out_file, freeze_step: int) -> None:
  """One heat map per layer: each head's open probability over the pruning run."""
  records = [json.loads(line)
             for line in epath.Path(history_file).read_text().splitlines()]
  steps = [r["step"] for r in records]
  num_layers = len(records[0]["open_prob"])
  fig, axes = plt.subplots(num_layers, 1, figsize=(8, 1.2 + 0.9 * num_layers), sharex=True,
                           squeeze=False)
  image = None
  for i, ax in enumerate(axes[:, 0]):
    probs_HxS = np.array([r["open_prob"][i] for r in records]).T
    if probs_HxS.size:
      image = ax.imshow(probs_HxS, aspect="auto", vmin=0.0, vmax=1.0, cmap="viridis",
                        interpolation="nearest",
                        extent=(steps[0], steps[-1], probs_HxS.shape[0] - 0.5, -0.5))
    ax.axvline(freeze_step, color="white", linestyle="--", linewidth=1)
    ax.set_ylabel(f"layer {i}\nhead")
  axes[-1, 0].set_xlabel("pruning step (dashed: gates frozen)")
  if image is not None:
    fig.colorbar(image, ax=axes[:, 0].tolist(), label="P(gate open)")
  fig.suptitle("Head gate open probabilities during pruning")
  with epath.Path(out_file).open("wb") as f:   # matplotlib cannot write to a bucket
    fig.savefig(f, format="png", dpi=100)
  plt.close(fig)
