"""Every figure: the pruning run's gate heat map (the demo's gates.png), the cost
model (the paper's Fig. 1) and the experiment suites' measured results.
"""
import dataclasses
import json
import pathlib

from etils import epath
import jax
import numpy as np

from allatt_jax.runs import checkpointing
from allatt_jax.config import config_base
from allatt_jax.config import errors
from allatt_jax.pruning import gate_values
from allatt_jax.pruning import cost_model
from allatt_jax.model import transformer as model_lib
from allatt_jax.config import run_config
from allatt_jax.runs import run_files

# The paper's WikiText-103 All-att (configs/wt103_base.py: 16 layers, d=512, H=8,
# N=2048) and its segment/memory lengths.
PAPER_MODEL = dict(kind="allatt", num_layers=16, d_model=512, num_heads=8,
                   num_persistent=2048, vocab_size=2)
PAPER_LENGTHS = (192, 192, 1)
COLORS = tuple(f"C{i}" for i in range(10))   # matplotlib's default cycle, tab10
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _figure(**kwargs):
  """A matplotlib figure of its own, outside pyplot: drawing it to a file changes no
  backend or pyplot state of the caller's (a notebook's own plots show as before).
  matplotlib is imported here, when a figure is drawn: its import takes half a
  second, which a run's start should not wait for."""
  from matplotlib import figure  # pylint: disable=g-import-not-at-top
  return figure.Figure(**kwargs)


def as_txl(cfg: model_lib.ModelConfig) -> model_lib.ModelConfig:
  """The Transformer-XL of the same width and heads (d_ff = 4d, no persistent)."""
  return dataclasses.replace(cfg, **config_base.txl_model(cfg.d_model))


def relative_costs(cfg: model_lib.ModelConfig, lengths) -> dict[str, np.ndarray]:
  """Non-embedding params and MACs per token, relative to the unpruned model, when
  every layer keeps k of its H heads, for k = H .. 0 (sparsity 0 .. 1)."""
  heads = cfg.num_heads
  kept = np.arange(heads, -1, -1)
  params = np.array([cfg.num_layers * cost_model.layer_param_count(cfg, k) for k in kept], float)
  macs = np.array([cfg.num_layers * cost_model.layer_macs_per_token(cfg, k, *lengths)
                   for k in kept])
  return {"sparsity": 1.0 - kept / heads, "params": params / params[0],
          "macs": macs / macs[0]}


def cost_model_figure(cfg: model_lib.ModelConfig, lengths, out_file) -> dict:
  """Fig. 1: relative params and MACs vs head sparsity, All-att vs TXL.

  Drawn for the experiment's model (solid) and the paper's WikiText-103 size
  (dashed). Returns the curves, for the suite's table.
  """
  paper = model_lib.ModelConfig(**PAPER_MODEL, max_relative_len=sum(PAPER_LENGTHS[:2]))
  curves = {("this model", "All-att"): relative_costs(cfg, lengths),
            ("this model", "TXL"): relative_costs(as_txl(cfg), lengths),
            ("paper WT103", "All-att"): relative_costs(paper, PAPER_LENGTHS),
            ("paper WT103", "TXL"): relative_costs(as_txl(paper), PAPER_LENGTHS)}
  fig = _figure(figsize=(10, 4.3))
  axes = fig.subplots(1, 2, sharey=True)
  colors = {"All-att": "tab:blue", "TXL": "tab:orange"}
  for ax, key in zip(axes, ("macs", "params")):
    for (size, kind), c in curves.items():
      # The two sizes often coincide: small filled dots inside large hollow squares
      # keep both visible.
      ours = size == "this model"
      ax.plot(100 * c["sparsity"], 100 * c[key], color=colors[kind],
              linestyle="-" if ours else "--", marker="o" if ours else "s",
              markersize=4 if ours else 9, markerfacecolor=None if ours else "none",
              label=f"{kind} ({size})")
    ax.set_xlabel("head sparsity (%)")
    ax.set_title("MACs per token" if key == "macs" else "parameters (w/o embedding)")
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("relative to the unpruned model (%)")
  axes[0].legend(fontsize=8, loc="lower left")
  fig.suptitle("Cost of head pruning, uniform over layers (cost model)")
  _save(fig, out_file)
  return curves


@dataclasses.dataclass
class Series:
  label: str
  x: list[float]
  y: list[float]
  style: str = "o-"
  yerr: list[float] | None = None
  color: str | None = None
  hollow: bool = False   # open markers: points of several series at one place all show


def xy_figure(series: list[Series], xlabel: str, ylabel: str, title: str, out_file,
              hline: tuple[str, float] | None = None, xlog: bool = False) -> None:
  fig = _figure(figsize=(6.5, 4.5))
  ax = fig.subplots()
  for s in series:
    ax.errorbar(s.x, s.y, yerr=s.yerr, fmt=s.style, label=s.label, capsize=3,
                color=s.color, markersize=9 if s.hollow else 6,
                markerfacecolor="none" if s.hollow else None,
                markeredgewidth=1.5 if s.hollow else 1.0)
  if hline:
    ax.axhline(hline[1], color="gray", linestyle=":", label=hline[0])
  if xlog:
    ax.set_xscale("log")
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  _save(fig, out_file)


def bar_figure(labels, values, errors, ylabel: str, title: str, out_file) -> None:
  fig = _figure(figsize=(6.5, 4))
  ax = fig.subplots()
  ax.bar(labels, values, yerr=errors, capsize=4, color="tab:blue")
  ax.axhline(0.0, color="black", linewidth=0.8)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(alpha=0.3, axis="y")
  _save(fig, out_file)


def trajectories_figure(runs: dict[str, dict[str, list]], out_file) -> None:
  """Budget runs: controlled open heads and their target over the gate phase."""
  fig = _figure(figsize=(7, 4.8))
  ax = fig.subplots()
  for (label, values), color, marker in zip(runs.items(), COLORS, MARKERS):
    steps, open_heads, target = values["step"], values["open"], values["target"]
    # Runs that reach the same head count draw the same line: each run's own hollow
    # markers keep it visible.
    ax.plot(steps, open_heads, color=color, marker=marker, markerfacecolor="none",
            markersize=8, label=label)
    ax.plot(steps, target, color=color, linestyle="--", linewidth=1)
  ax.set_xlabel("pruning step")
  ax.set_ylabel("heads")
  ax.set_title("Budget controller: its count of open heads, σ(k·π) summed (markers), "
               "and target (dashed)\nuntil the freeze; from there the run keeps exactly "
               "the target's heads", fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  _save(fig, out_file)


def _save(fig, out_file) -> None:
  if jax.process_index() == 0:    # every process of a multi-host run draws; one writes
    pathlib.Path(out_file).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out_file, dpi=100)


def gated_run(path) -> epath.Path:
  """The pruning run whose gates `path` draws: `path` itself, or, for a pipeline's
  workdir, its newest pruning stage (pruned-N with the highest N, else pruned).

  Raises:
    CheckpointError: `path` is neither, naming the run to draw where it knows one (an
      export's pruning run, a pipeline's pruning stage).
  """
  path = run_files.run_path(path)
  if not (path / run_files.CONFIG_FILE).is_file():
    stages = run_files.pruning_stages(path)
    if stages:
      return gated_run(stages[-1])
    if (path / "baseline" / run_files.CONFIG_FILE).is_file():
      raise errors.CheckpointError(
          f"{path} is a pipeline's workdir whose pruning stage has not started: it has "
          "no gates yet. Rerun the pipeline's command to train it, then draw its gates.")
  config = run_files.load_config(path)   # its advice for a folder without one
  if config.gates.enabled and (path / run_files.GATE_HISTORY_FILE).is_file():
    return path
  if config.gates.enabled:
    raise errors.CheckpointError(
        f"{path} is a pruning run that has logged no step yet: its "
        f"{run_files.GATE_HISTORY_FILE} starts at its first logging step "
        "(train.log_every_steps). Draw it once it has trained that far.")
  if (path / "params").is_dir():
    source = path.parent
    known = ((source / run_files.GATE_HISTORY_FILE).is_file()
             and run_files.load_config(source).gates.enabled)
    where = (f"Draw the pruning run it was exported from: --workdir={source}" if known
             else "Draw the pruning run it was exported from (give its --workdir)")
    raise errors.CheckpointError(
        f"{path} is an exported model: its closed heads are cut and its gates folded "
        f"away, so it has no gates to draw. {where}.")
  pipeline_stages = run_files.pruning_stages(path.parent)
  where = (f"Draw its pipeline's pruning stage: --workdir={pipeline_stages[-1]} (or "
           f"--workdir={path.parent})" if pipeline_stages
           else "Draw a pruning run's --workdir (gates.enabled=True)")
  raise errors.CheckpointError(
      f"{path} is not a pruning run with a {run_files.GATE_HISTORY_FILE}: only pruning "
      f"runs (gates.enabled=True) have gates to draw. {where}.")


def gate_figure(workdir, out_file=None) -> epath.Path:
  """The gates of a pruning run: each head's open probability at every logged step
  while the gates are sampled (an expectation), and from the freeze on, when they
  are deterministic, the decision (1 kept, 0 removed); one row per head, one panel
  per layer. The heads its export keeps are marked ✓ and the removed ones ✗ at the
  end, by the rule export uses (`gate_values.Gates.surviving_heads` on the final
  checkpoint's gate logits). `workdir`: a pruning run, or a pipeline's workdir (its
  newest pruning stage: `gated_run`). Writes gates.png in the run drawn unless
  `out_file` is given. In a multi-process run every process calls it (reading the
  checkpoint is collective) and process 0 draws.

  Raises:
    CheckpointError: `workdir` is not a pruning run with a gate history and a
      finished checkpoint (`gated_run`'s advice).
  """
  workdir = gated_run(workdir)
  config = run_files.load_config(workdir)
  history_file = workdir / run_files.GATE_HISTORY_FILE
  records = [json.loads(line) for line in history_file.read_text().splitlines()]
  cfg = model_lib.ModelConfig.from_config(config)
  kept = gate_values.read(cfg, checkpointing.read_model(workdir)[1]["gates"]).surviving_heads
  out_file = epath.Path(out_file) if out_file else workdir / "gates.png"
  if jax.process_index() == 0:
    _draw_gates(records, kept, cfg.layer_heads, config.gates, out_file)
  return out_file


def _draw_gates(records, kept, layer_heads, gates: run_config.GatesSection,
                out_file) -> None:
  steps = np.array([r["step"] for r in records], float)
  # Cell edges halfway between logged steps, so each cell is centred on its step.
  gaps = np.diff(steps) if len(steps) > 1 else np.array([1.0])
  edges = np.concatenate([[steps[0] - gaps[0] / 2], steps[:-1] + gaps / 2,
                          [steps[-1] + gaps[-1] / 2]])
  groups = records[-1].get("persistent_decided")
  fig = _figure(layout="constrained", figsize=(
      12 if groups else 9, 1.6 + 0.25 * sum(max(h, 1) for h in layer_heads)))
  axes = fig.subplots(len(layer_heads), 2 if groups else 1, sharex="col", squeeze=False,
                      gridspec_kw=dict(height_ratios=[max(h, 1) for h in layer_heads],
                                       **({"width_ratios": [3, 1]} if groups else {})))
  if groups:
    _draw_group_decisions(axes[:, 1], groups, kept, layer_heads)
  image = None
  # Histories written before the decision was recorded show probabilities throughout.
  decided = [r.get("decided") if r["step"] > gates.freeze_step else None for r in records]
  shows_decisions = any(d is not None for d in decided)
  for i, ax in enumerate(axes[:, 0]):
    probs_HxS = np.array([r["open_prob"][i] if d is None else d[i]
                          for r, d in zip(records, decided)], float).reshape(
                              len(records), -1).T
    ax.set_ylabel(f"layer {i}\n{len(kept[i])}/{layer_heads[i]} kept", fontsize=8)
    if not probs_HxS.size:
      ax.set_yticks([])
      continue
    image = ax.pcolormesh(edges, np.arange(probs_HxS.shape[0] + 1) - 0.5, probs_HxS,
                          vmin=0.0, vmax=1.0, cmap="viridis")
    ax.set_ylim(probs_HxS.shape[0] - 0.5, -0.5)
    heads = range(probs_HxS.shape[0])
    ax.set_yticks(heads, [f"h{h}" for h in heads], fontsize=7)
    # The export's verdict at the end of each head's row.
    verdict = ax.secondary_yaxis("right")
    verdict.set_yticks(heads, ["✓ kept" if h in kept[i] else "✗ removed" for h in heads],
                       fontsize=7)
    for label, h in zip(verdict.get_yticklabels(), heads):
      label.set_color("tab:green" if h in kept[i] else "tab:red")
    if gates.freeze_step:
      ax.axvline(gates.freeze_step, color="white", linestyle="--", linewidth=1)
  if not gates.freeze_step:   # deterministic from the first step: no line to draw
    frozen = (" (gates frozen from the start: the decision, 1 kept, 0 removed)"
              if shows_decisions else "")
  else:
    frozen = (" (dashed: gates frozen; before, P(gate open) of the sampled gates; after, "
              "the decision: 1 kept, 0 removed)" if shows_decisions
              else " (dashed: gates frozen)")
  axes[-1, 0].set_xlabel("pruning step" + frozen)
  if image is not None:
    fig.colorbar(image, ax=axes[:, 0].tolist(), aspect=40,
                 label="P(gate open) / decision" if shows_decisions else "P(gate open)")
  total = sum(layer_heads)
  sparsity = 1.0 - sum(len(k) for k in kept) / total
  strength = f"budget {gates.budget_shown}" if gates.budget_target else f"λ={gates.lam:g}"
  if groups:
    kept_groups = sum(sum(groups[i][h]) for i, heads in enumerate(kept) for h in heads)
    strength += (f"; persistent groups of {gates.persistent_group} slots kept: "
                 f"{kept_groups} of {sum(len(g) for layer in groups for g in layer)} "
                 "(right: the decision per head, a removed head's row grey)")
  fig.suptitle(f"Head gates during pruning: {strength}, final head sparsity "
               f"{100 * sparsity:.1f}%\nheads kept per layer: "
               f"{' '.join(str(len(k)) for k in kept)} of "
               f"{' '.join(map(str, layer_heads))}  (kept: deterministic gate open at the "
               "end, as export decides)", fontsize=9)
  with out_file.open("wb") as f:   # matplotlib cannot write to a bucket
    fig.savefig(f, format="png", dpi=100, bbox_inches="tight")


def _draw_group_decisions(axes, groups, kept, layer_heads) -> None:
  """Per layer, each head's persistent groups as the export keeps them (1) or cuts
  them (0); the groups of a removed head go with it (grey)."""
  from matplotlib import colormaps  # pylint: disable=g-import-not-at-top
  cmap = colormaps["viridis"].with_extremes(bad="lightgrey")
  for i, ax in enumerate(axes):
    decided_HxG = np.array(groups[i], float).reshape(layer_heads[i], -1)
    if not decided_HxG.size:
      ax.set_axis_off()
      continue
    decided_HxG[[h for h in range(layer_heads[i]) if h not in kept[i]]] = np.nan
    ax.imshow(np.ma.masked_invalid(decided_HxG), cmap=cmap, vmin=0.0, vmax=1.0,
              aspect="auto", interpolation="nearest")
    ax.set_yticks(range(layer_heads[i]), [f"h{h}" for h in range(layer_heads[i])],
                  fontsize=7)
    kept_groups = int(np.nansum(decided_HxG))
    ax.set_title(f"layer {i}: {kept_groups} groups kept", fontsize=8)
  axes[-1].set_xlabel("persistent group (final decision)")
