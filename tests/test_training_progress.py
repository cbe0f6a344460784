"""What a run reports as it goes. A pruning run, through its gate freeze: the progress
lines' heads and groups (expected, decided, kept), the rate around the steps that
compile, the summaries without skipped steps, and the gate history. A baseline run:
its summaries without gate metrics, its rate without its evaluations' time, and its
final results."""
import json
import types

import numpy as np

import helpers
from helpers import GROUP_LOGITS
from helpers import HEAD_LOGITS
from allatt_jax.config import run_config
from allatt_jax.model import transformer as model_lib
from allatt_jax.runs import run_files
from allatt_jax.training import progress

GROUP = 2          # 4 groups of the 8 persistent slots of each head
# helpers' logits decide 7 heads of 8 and, of those heads, 16 groups of 32: layer 0's
# heads keep 4, -, 0 and 2 groups, layer 1's 3, 4, 2 and 1.
FREEZE, NUM_STEPS = 3, 6


def step_metrics(nll):
  per_layer = lambda total: np.array([total / 2, total / 2], np.float32)
  return {"loss": np.float32(nll), "nll": np.float32(nll), "grad_norm": np.float32(1.0),
          "l0": np.float32(6.5), "lambda": np.float32(0.01),
          "open_expected": per_layer(6.5), "open_actual": per_layer(6.0),
          "groups_open_actual": per_layer(20.0)}


def test_a_pruning_runs_lines_rate_summaries_and_gate_history(tmp_path, monkeypatch, capsys):
  clock = [0.0]
  monkeypatch.setattr(progress, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
  cfg = model_lib.ModelConfig(kind="allatt", vocab_size=11, num_layers=2, d_model=16,
                              num_heads=4, num_persistent=8, max_relative_len=32,
                              gated=True,
                              gate=run_config.GatesSection(persistent_group=GROUP))
  gates = {f"layer_{i}": {"attention": {"logits": np.array(HEAD_LOGITS[i], np.float32),
                                        "persistent_logits": np.array(GROUP_LOGITS[i],
                                                                      np.float32)}}
           for i in range(2)}
  run = progress.TrainProgress(tmp_path, cfg, num_steps=NUM_STEPS, first_step=0,
                               tokens_per_step=64, metric="bpc", skip_nonfinite=True,
                               gated=True, freeze_step=FREEZE)
  # Steps 1 and 4 (the first with frozen gates) compile; step 5 is not finite.
  seconds = {1: 30.0, 4: 20.0}
  nll = {1: 4.0, 2: 2.0, 3: 2.0, 4: 1.0, 5: np.nan, 6: 3.0}
  lines = {}
  for done in range(1, NUM_STEPS + 1):
    clock[0] += seconds.get(done, 0.5)
    run.add(done, step_metrics(nll[done]))
    if done in (2, FREEZE, NUM_STEPS):
      run.log(done, run.fetch(done), gates)
      lines[done] = capsys.readouterr().out.splitlines()[-1]
  run.close()

  # Up to the freeze step itself the gates were sampled: expected counts and decisions.
  for done in (2, FREEZE):
    assert "heads open 6.0/8 expected, 7 decided" in lines[done], lines[done]
    assert "groups open 20.0/32 expected, 16 decided" in lines[done], lines[done]
  assert "heads kept 7/8 (frozen)  groups kept 16/32 (frozen)" in lines[NUM_STEPS]
  # The last line: steps 4 and 6 (step 5 skipped; those before, logged already), the
  # rate from the end of step 4.
  bpc = 2.0 / np.log(2)
  assert f"bpc {bpc:.4f}" in lines[NUM_STEPS] and "2.0 steps/s  ETA 0s" in lines[NUM_STEPS]

  history = [json.loads(line) for line in
             (run_files.run_path(tmp_path) / run_files.GATE_HISTORY_FILE).read_text()
             .splitlines()]
  assert [record["step"] for record in history] == [2, FREEZE, NUM_STEPS]
  record = history[-1]
  assert record["decided"] == [[1, 0, 1, 1], [1, 1, 1, 1]]
  assert record["persistent_decided"][0][3] == [1, 0, 1, 0]    # slots 0-1 and 4-5
  assert record["persistent_decided"][1] == [[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 0],
                                             [0, 0, 1, 0]]
  np.testing.assert_allclose(record["open_prob"][1], 1 / (1 + np.exp(-2.0)), rtol=1e-6)


def test_a_baseline_runs_summaries_rate_and_results(tmp_path, monkeypatch):
  clock = [0.0]
  monkeypatch.setattr(progress, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
  writer = helpers.RecordingWriter()
  monkeypatch.setattr(progress, "_clu", lambda: (
      types.SimpleNamespace(create_default_writer=lambda *args, **kwargs: writer),
      types.SimpleNamespace(ReportProgress=lambda **kwargs: lambda step: None)))
  cfg = model_lib.ModelConfig(kind="allatt", vocab_size=11, num_layers=2, d_model=16,
                              num_heads=4, num_persistent=8, max_relative_len=32)
  run = progress.TrainProgress(tmp_path, cfg, num_steps=4, first_step=0,
                               tokens_per_step=64, metric="bpc", skip_nonfinite=False,
                               gated=False)
  # Step 1 compiles; an evaluation of 100 s follows step 2's log, as in the train loop.
  for done in range(1, 5):
    clock[0] += 30.0 if done == 1 else 0.5
    run.add(done, step_metrics(2.0))   # a baseline's step reports l0 = 0 and the like too
    if done in (2, 4):
      run.log(done, run.fetch(done), None)
    if done == 2:
      clock[0] += 100.0
      run.write_eval(done, {"valid": 3.0})
  run.write_final(4, {"valid": 2.5, "test": 2.6})
  run.close()

  last = writer.scalars[4]
  assert last["tokens_per_s"] == 2.0 * 64      # steps 3 and 4 in 1 s, not the evaluation
  assert not any(key.split("/")[0] in progress.GATE_METRICS for key in last)
  assert writer.scalars[2]["eval/valid"] == 3.0
  assert (last["final/valid"], last["final/test"]) == (2.5, 2.6)


def test_a_run_gating_only_groups_reports_groups_not_heads(tmp_path, capsys):
  """With `gates.heads=False` every head stays, ungated: the lines count groups only,
  of all 8 heads."""
  cfg = model_lib.ModelConfig(kind="allatt", vocab_size=11, num_layers=2, d_model=16,
                              num_heads=4, num_persistent=8, max_relative_len=32,
                              gated=True, gate=run_config.GatesSection(
                                  persistent_group=GROUP, heads=False))
  gates = {f"layer_{i}": {"attention": {"persistent_logits": np.array(GROUP_LOGITS[i],
                                                                       np.float32)}}
           for i in range(2)}
  run = progress.TrainProgress(tmp_path, cfg, num_steps=NUM_STEPS, first_step=0,
                               tokens_per_step=64, metric="bpc", skip_nonfinite=False,
                               gated=True, freeze_step=FREEZE)
  for done in range(1, NUM_STEPS + 1):
    run.add(done, step_metrics(2.0))
  run.log(NUM_STEPS, run.fetch(NUM_STEPS), gates)
  run.close()
  line = capsys.readouterr().out.splitlines()[-1]
  # helpers' group logits open 4, 1, 0, 2 groups of layer 0's heads, 3, 4, 2, 1 of
  # layer 1's.
  assert "  groups kept 17/32 (frozen)  λ 0.01" in line, line
  assert "heads" not in line, line
