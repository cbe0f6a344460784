"""The Colab notebooks run headlessly, top to bottom, at the demo's tiny settings.

Needs nbclient, nbformat and ipykernel (the `notebooks` extra); skipped without them.
"""
import os
import pathlib

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

COLAB = pathlib.Path(__file__).resolve().parents[1] / "launch" / "colab"


def execute(name: str):
  """Runs a notebook in a fresh kernel (cwd: its folder); returns the executed notebook."""
  notebook = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
  nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(COLAB)}}).execute()
  return notebook


def outputs(notebook) -> list[dict]:
  return [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]


def printed(notebook) -> str:
  return "\n".join(o.get("text", "") for o in outputs(notebook))


@pytest.fixture(scope="module")
def demo_env(tmp_path_factory):
  """Tiny settings for the notebooks' parameter cells, through the kernel's environment."""
  workdir = tmp_path_factory.mktemp("colab") / "demo"
  values = {"ALLATT_DEMO_CONFIG": "tiny", "ALLATT_WORKDIR": str(workdir),
            "ALLATT_NUM_TOKENS": "40", "ALLATT_EVAL_BATCHES": "20",
            "TFDS_DATA_DIR": os.environ.get("TFDS_DATA_DIR")
                             or str(tmp_path_factory.mktemp("tfds"))}
  previous = {k: os.environ.get(k) for k in values}
  os.environ.update(values)
  yield workdir
  for key, value in previous.items():
    if value is None:
      os.environ.pop(key)
    else:
      os.environ[key] = value


def test_parameter_cells_are_tagged():
  for name in ("train_prune_export", "evaluate_and_sample"):
    notebook = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
    tagged = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and "os.environ.get" in tagged[0].source
    assert all(not c.get("outputs") for c in notebook.cells if c.cell_type == "code")


@pytest.mark.slow
def test_train_prune_export_then_evaluate_and_sample(demo_env):
  notebook = execute("train_prune_export")
  assert "speed-up" in printed(notebook) and "head sparsity" in printed(notebook)
  images = [o for o in outputs(notebook) if "image/png" in o.get("data", {})]
  assert len(images) == 2                    # the gate heat map and the speed bars
  assert (demo_env / "pruned" / "export" / "config.json").is_file()

  notebook = execute("evaluate_and_sample")
  text = printed(notebook)
  assert "valid bpc" in text and "test bpc" in text
  assert text.count("--- temperature") == 2 and "the history of the" in text
