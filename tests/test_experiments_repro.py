"""The accelerator suite `repro` at tiny size on CPU: its time box (stop with a
checkpoint, exit 143, resume), then baseline → prune → export → table → plot."""
import json
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from helpers import train_run
import data_fixtures
from allatt_jax.runs import checkpointing
from allatt_jax.config import config_base
from allatt_jax import data as data_lib
from allatt_jax.training import assembly
from allatt_jax.config.errors import Preempted
from allatt_jax.experiments import __main__ as cli
from allatt_jax.experiments import plan as plan_lib
from allatt_jax.experiments import runs as runs_lib

pytestmark = pytest.mark.slow   # every test here trains runs or starts processes

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "repro_wt2.py"


@pytest.fixture(scope="module", autouse=True)
def fast_compiles():
  """XLA with most optimisations off: compiling, not running, is what these tiny runs
  spend their time on (about half as much CPU in all)."""
  before = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", before)


def _articles(rng, words, count):
  """Articles of sentences from a few fixed word sequences, so a model can learn them."""
  phrases = [list(rng.choice(words, size=5)) for _ in range(12)]
  lines = []
  for i in range(count):
    paragraphs = [" ".join(w for _ in range(4) for w in phrases[rng.integers(12)]) + " ."
                  for _ in range(6)]
    lines += data_fixtures.wikitext_article(f"Article {i}", paragraphs)
  return lines


@pytest.fixture(scope="module")
def config(tmp_path_factory):
  """configs/repro_wt2.py:tiny on a WikiText-2-shaped corpus of ~110 types."""
  raw = tmp_path_factory.mktemp("wikitext-2")
  rng = np.random.default_rng(0)
  words = np.array([f"w{i}" for i in range(100)] + ["<unk>"])
  data_fixtures.write_wikitext(raw, {"train": _articles(rng, words, 40),
                                     "valid": _articles(rng, words, 3),
                                     "test": _articles(rng, words, 3)})
  c = config_base.load(CONFIG, "tiny")
  c.data.manual_dir = str(raw)
  c.data.data_dir = str(tmp_path_factory.mktemp("tfds"))
  c.model.vocab_size = data_lib.load_corpus("wikitext2", c.data.data_dir,
                                            c.data.manual_dir).vocab_size
  return c


def _cli(config, workdir, *flags):
  return subprocess.run(
      [sys.executable, "-m", "allatt_jax.experiments", "--suite=repro",
       f"--config={CONFIG}:tiny", f"--config.data.manual_dir={config.data.manual_dir}",
       f"--config.data.data_dir={config.data.data_dir}",
       f"--config.model.vocab_size={config.model.vocab_size}", f"--workdir={workdir}",
       *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_time_boxed_slices_then_the_whole_suite(config, tmp_path):
  # A spent time box: no run starts, and the command says how to go on.
  result = _cli(config, tmp_path, "--max_minutes=0")
  assert result.returncode == 143, result.stderr[-2000:]
  assert "Time box reached before run baseline started" in result.stderr
  assert not (tmp_path / "runs").exists()

  # A deadline inside a run stops it like SIGTERM: a checkpoint of the step, no results.
  base = assembly.checked_config(config)
  plan = plan_lib.Plan.from_dict(config.experiments.to_dict())
  exp = runs_lib.Experiment(base, plan, tmp_path)
  baseline_dir = exp.run_dir("baseline")
  with pytest.raises(Preempted, match="Time box reached: saved a checkpoint at step 1 "):
    train_run(exp.base, baseline_dir, deadline=time.monotonic())
  assert checkpointing.latest_finished_step(baseline_dir) == 1
  assert not (baseline_dir / runs_lib.RESULTS_FILE).exists()
  late = runs_lib.Experiment(base, plan, tmp_path, deadline=time.monotonic())
  with pytest.raises(Preempted, match="before run baseline started"):
    late.baseline()

  # The rerun resumes the baseline and runs the rest: prune, export, table, figure.
  report = cli.run_suite("repro", exp)
  text = (tmp_path / "repro.md").read_text()
  rows = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ")]
  assert rows[1:] == ["| All-att d=32", "| All-att L0 (seed 0)", "| TXL d=32"]
  assert "cpu" in text and "float32 compute" in text
  assert (tmp_path / "repro_fig3.png").stat().st_size > 1000
  assert "(repro_fig3.png)" in text
  base, pruned, txl = report.records
  assert (base.kind, pruned.kind, txl.kind) == ("baseline", "l0", "txl")
  assert all(np.isfinite(r.test) and r.test > 1 for r in report.records)
  # Equal width, equal non-embedding parameters: the premise of Fig. 3.
  assert abs(txl.params_non_embedding / base.params_non_embedding - 1) < 0.02
  # Heads were removed; the exported model is that much smaller and scores what the
  # gated model it came from scored.
  assert pruned.heads < base.heads
  assert pruned.params_non_embedding < base.params_non_embedding
  np.testing.assert_allclose(pruned.test, pruned.extra["gated_test"], rtol=1e-4)
  results = json.loads((exp.run_dir(pruned.name) / runs_lib.RESULTS_FILE).read_text())
  assert results["export"]["heads_per_layer"] == pruned.heads_per_layer


def test_scale_multiplies_every_step_count():
  one, two = config_base.load(CONFIG), config_base.load(CONFIG, "scale=2")
  for key in ("train.num_steps", "train.warmup_steps", "eval.every_steps",
              "checkpoint.every_steps", "experiments.prune_train.num_steps",
              "experiments.prune_train.warmup_steps",
              "experiments.prune_gates.l0_warmup_steps",
              "experiments.prune_gates.freeze_step"):
    section, name = key.rsplit(".", 1)
    assert two[section][name] == 2 * one[section][name], key
  assert two.model == one.model and two.experiments.lambdas == one.experiments.lambdas
