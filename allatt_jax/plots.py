"""Every figure: the pruning run's gate heat map (the demo's gates.png), the cost
model (the paper's Fig. 1) and the experiment suites' measured results."""
import dataclasses
import json
import pathlib

from etils import epath
import jax
import matplotlib
import numpy as np

from allatt_jax import costs
from allatt_jax import model as model_lib

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

# The paper's WikiText-103 All-att (configs/wt103_base.py: 16 layers, d=512, H=8,
# N=2048) and its segment/memory lengths.
PAPER_MODEL = dict(kind="allatt", num_layers=16, d_model=512, num_heads=8,
                   num_persistent=2048, vocab_size=2)
PAPER_LENGTHS = (192, 192, 1)
COLORS = tuple(matplotlib.colormaps["tab10"].colors)


def as_txl(cfg: model_lib.ModelConfig) -> model_lib.ModelConfig:
  """The Transformer-XL of the same width and heads (d_ff = 4d, no persistent)."""
  return dataclasses.replace(cfg, kind="txl", d_ff=4 * cfg.d_model, num_persistent=0)


def relative_costs(cfg: model_lib.ModelConfig, lengths) -> dict[str, np.ndarray]:
  """Non-embedding params and MACs per token, relative to the unpruned model, when
  every layer keeps k of its H heads, for k = H .. 0 (sparsity 0 .. 1)."""
  heads = cfg.num_heads
  kept = np.arange(heads, -1, -1)
  params = np.array([cfg.num_layers * costs.layer_param_count(cfg, k) for k in kept], float)
  macs = np.array([cfg.num_layers * costs.layer_macs_per_token(cfg, k, *lengths)
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
  fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
  colors = {"All-att": "tab:blue", "TXL": "tab:orange"}
  for ax, key in zip(axes, ("macs", "params")):
    for (size, kind), c in curves.items():
      ax.plot(100 * c["sparsity"], 100 * c[key], color=colors[kind],
              linestyle="-" if size == "this model" else "--", marker=".",
              label=f"{kind} ({size})")
    ax.set_xlabel("head sparsity (%)")
    ax.set_title("MACs per token" if key == "macs" else "parameters (w/o embedding)")
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("relative to the unpruned model (%)")
  axes[1].legend()
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


def xy_figure(series: list[Series], xlabel: str, ylabel: str, title: str, out_file,
              hline: tuple[str, float] | None = None, xlog: bool = False) -> None:
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for s in series:
    ax.errorbar(s.x, s.y, yerr=s.yerr, fmt=s.style, label=s.label, capsize=3,
                color=s.color)
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
  fig, ax = plt.subplots(figsize=(6.5, 4))
  ax.bar(labels, values, yerr=errors, capsize=4, color="tab:blue")
  ax.axhline(0.0, color="black", linewidth=0.8)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(alpha=0.3, axis="y")
  _save(fig, out_file)


def trajectories_figure(runs: dict[str, dict[str, list]], out_file) -> None:
  """Budget runs: controlled open heads and their target over the gate phase."""
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for (label, values), color in zip(runs.items(), COLORS):
    steps, open_heads, target = values["step"], values["open"], values["target"]
    ax.plot(steps, open_heads, color=color, label=f"{label}: E[open heads]")
    ax.plot(steps, target, color=color, linestyle="--", linewidth=1)
  ax.set_xlabel("pruning step")
  ax.set_ylabel("heads")
  ax.set_title("Budget controller: expected open heads (solid) and target (dashed)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  _save(fig, out_file)


def _save(fig, out_file) -> None:
  if jax.process_index() == 0:    # every process of a multi-host run draws; one writes
    pathlib.Path(out_file).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out_file, dpi=100)
  plt.close(fig)


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
