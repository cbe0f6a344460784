"""What the figures show: the gate heat map's cells, verdicts and title from a run's
gate history, and the cost model's curves against the parameter and MAC counts."""
import dataclasses

from etils import epath
from matplotlib import figure
import numpy as np
import pytest

from helpers import fresh_python_prints
from allatt_jax.config import run_config
from allatt_jax.model import transformer as model_lib
from allatt_jax.pruning import cost_model
from allatt_jax.reports import figures


@pytest.fixture
def drawn(monkeypatch):
  """The figures drawn, as they were written."""
  figs, real_savefig = [], figure.Figure.savefig

  def savefig(fig, *args, **kwargs):
    figs.append(fig)
    return real_savefig(fig, *args, **kwargs)
  monkeypatch.setattr(figure.Figure, "savefig", savefig)
  return figs


def history(**extra):
  """A gate history of 2 layers of 2 heads, logged at steps 10, 20, 30 and 40, each
  with the heads the deterministic rule keeps then."""
  probs = {10: [[0.9, 0.2], [0.6, 0.5]], 20: [[0.95, 0.1], [0.7, 0.4]],
           30: [[0.99, 0.05], [0.8, 0.45]], 40: [[0.99, 0.05], [0.8, 0.45]]}
  return [{"step": step, "open_prob": p, "decided": [[1, 0], [1, 0]], **extra}
          for step, p in probs.items()]


def draw(tmp_path, drawn, records, kept, layer_heads=(2, 2), **gates):
  out = epath.Path(tmp_path) / "gates.png"
  figures._draw_gates(records, kept, layer_heads, run_config.GatesSection(**gates), out)
  assert out.read_bytes()[:4] == b"\x89PNG"
  [fig] = drawn
  return fig


def test_the_gate_map_shows_probabilities_until_the_freeze_then_the_decision(
    tmp_path, drawn):
  fig = draw(tmp_path, drawn, history(), [[0], [0]], enabled=True, lam=0.1,
             freeze_step=20)
  layer0 = fig.axes[0]
  [mesh] = layer0.collections
  # One row a head, one column a logged step; from the step after the freeze, 0 or 1.
  np.testing.assert_allclose(mesh.get_array().reshape(2, 4),
                             [[0.9, 0.95, 1.0, 1.0], [0.2, 0.1, 0.0, 0.0]])
  # Cells centred on their steps.
  np.testing.assert_allclose(mesh.get_coordinates()[0, :, 0], [5, 15, 25, 35, 45])
  [freeze] = [line for line in layer0.lines if line.get_linestyle() == "--"]
  assert freeze.get_xdata()[0] == 20
  assert layer0.get_ylabel() == "layer 0\n1/2 kept"
  assert "the decision: 1 kept, 0 removed" in fig.axes[1].get_xlabel()
  title = fig._suptitle.get_text()
  assert "λ=0.1, final head sparsity 50.0%" in title
  assert "heads kept per layer: 1 1 of 2 2" in title


def test_each_heads_verdict_is_the_exports(tmp_path, drawn):
  """✓ for the heads the export keeps (`kept`), ✗ for the others, in their colours,
  whatever the last probabilities look like."""
  fig = draw(tmp_path, drawn, history(), [[1], [0, 1]], enabled=True,
             target_sparsity=0.25, freeze_step=20)
  verdicts = [child for ax in fig.axes[:2] for child in ax.child_axes]
  labels = [[(t.get_text(), t.get_color()) for t in v.get_yticklabels()] for v in verdicts]
  assert labels == [[("✗ removed", "tab:red"), ("✓ kept", "tab:green")],
                    [("✓ kept", "tab:green"), ("✓ kept", "tab:green")]]
  assert [ax.get_ylabel() for ax in fig.axes[:2]] == ["layer 0\n1/2 kept",
                                                       "layer 1\n2/2 kept"]
  title = fig._suptitle.get_text()
  assert "budget target_sparsity=0.25, final head sparsity 25.0%" in title


def test_a_budget_asked_as_a_fraction_is_titled_as_asked_beside_its_figure(tmp_path, drawn):
  fig = draw(tmp_path, drawn, history(), [[0], [0]], enabled=True, freeze_step=20,
             target_macs=226099.2, budget_fraction=0.4)
  assert "budget target_macs=0.4 (226,099), final" in fig._suptitle.get_text()


def test_a_history_without_decisions_shows_probabilities_throughout(tmp_path, drawn):
  records = [{k: v for k, v in r.items() if k != "decided"} for r in history()]
  fig = draw(tmp_path, drawn, records, [[0], [0]], enabled=True, lam=0.1,
             freeze_step=20)
  np.testing.assert_allclose(fig.axes[0].collections[0].get_array().reshape(2, 4),
                             [[0.9, 0.95, 0.99, 0.99], [0.2, 0.1, 0.05, 0.05]])
  assert fig.axes[1].get_xlabel() == "pruning step (dashed: gates frozen)"


def test_gates_frozen_from_the_start_show_the_decision_without_a_line(tmp_path, drawn):
  fig = draw(tmp_path, drawn, history(), [[0], [0]], enabled=True, lam=0.1,
             freeze_step=0)
  np.testing.assert_allclose(fig.axes[0].collections[0].get_array().reshape(2, 4),
                             [[1, 1, 1, 1], [0, 0, 0, 0]])
  assert not [line for line in fig.axes[0].lines if line.get_linestyle() == "--"]
  assert fig.axes[1].get_xlabel() == ("pruning step (gates frozen from the start: the "
                                      "decision, 1 kept, 0 removed)")


def test_layers_of_other_head_counts_each_get_their_rows(tmp_path, drawn):
  """A run started from an export: 3 heads in layer 0, none left in layer 1."""
  records = [{"step": step, "open_prob": [[0.9, 0.2, 0.6], []], "decided": [[1, 0, 1], []]}
             for step in (10, 20)]
  fig = draw(tmp_path, drawn, records, [[0, 2], []], layer_heads=(3, 0), enabled=True,
             lam=0.1, freeze_step=20)
  assert [ax.get_ylabel() for ax in fig.axes[:2]] == ["layer 0\n2/3 kept",
                                                       "layer 1\n0/0 kept"]
  np.testing.assert_allclose(fig.axes[0].collections[0].get_array().reshape(3, 2),
                             [[0.9, 0.9], [0.2, 0.2], [0.6, 0.6]])
  assert not fig.axes[1].collections and not fig.axes[1].get_yticks().size
  assert "final head sparsity 33.3%" in fig._suptitle.get_text()


def test_the_group_panel_greys_a_removed_heads_groups(tmp_path, drawn):
  groups = [[[1, 0], [1, 1]], [[0, 1], [1, 1]]]   # per layer, head, group of slots
  fig = draw(tmp_path, drawn, history(persistent_decided=groups), [[0], [0, 1]],
             enabled=True, lam=0.1, freeze_step=20, persistent_group=4)
  panels = [ax for ax in fig.axes if ax.get_title().startswith("layer ")]
  assert [ax.get_title() for ax in panels] == ["layer 0: 1 groups kept",
                                                "layer 1: 3 groups kept"]
  shown = panels[0].images[0].get_array()
  assert shown[0].tolist() == [1.0, 0.0] and shown.mask[1].all()   # head 1 removed
  assert "persistent groups of 4 slots kept: 4 of 8" in fig._suptitle.get_text()


def test_the_cost_curves_are_the_models_counts_with_k_heads_a_layer():
  cfg = model_lib.ModelConfig(kind="allatt", vocab_size=50, num_layers=2, d_model=32,
                              num_heads=4, num_persistent=16, max_relative_len=32)
  lengths = (16, 16, 2)
  curves = figures.relative_costs(cfg, lengths)
  np.testing.assert_allclose(curves["sparsity"], [0.0, 0.25, 0.5, 0.75, 1.0])
  full = cost_model.param_counts(cfg)["params_non_embedding"]
  macs_of = lambda c: cost_model.macs_per_token(c, *lengths)["macs_per_token_non_embedding"]
  full_macs = macs_of(cfg)
  for k, params, macs in zip(range(4, -1, -1), curves["params"], curves["macs"]):
    smaller = dataclasses.replace(cfg, heads_per_layer=(k, k))
    assert params == pytest.approx(
        cost_model.param_counts(smaller)["params_non_embedding"] / full)
    assert macs == pytest.approx(macs_of(smaller) / full_macs)
  # The Transformer-XL of its width keeps its feed-forward: a floor above zero.
  txl = figures.relative_costs(figures.as_txl(cfg), lengths)
  assert txl["params"][-1] > 0.5 and curves["params"][-1] < txl["params"][-1]


def test_drawing_leaves_the_callers_matplotlib_as_it_was(tmp_path):
  """A notebook's own plots keep its backend: figures are drawn outside pyplot."""
  code = ("import sys, matplotlib; matplotlib.use('svg'); "
          "from allatt_jax.reports import figures; "
          "figures.bar_figure(['a'], [1.0], [0.1], 'y', 't', sys.argv[1]); "
          "print(matplotlib.get_backend(), 'matplotlib.pyplot' in sys.modules)")
  assert fresh_python_prints(code, tmp_path / "bar.png") == ["svg", "False"]
  assert (tmp_path / "bar.png").read_bytes().startswith(b"\x89PNG")
