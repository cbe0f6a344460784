"""The compile-only check: a pruning config with the full WikiText-103 vocabulary
compiles for 8 fake devices, and XLA's plan holds exactly the sharded state; a
pipeline compiles both its stages."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

import helpers

pytestmark = pytest.mark.slow   # every test here trains runs or starts processes

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("distill", [
    [],
    # With a teacher: its params sharded like the student's, the exact KL over the
    # 267,735-type adaptive softmax streamed in vocabulary blocks.
    pytest.param(["--config.distill.weight=0.5", "--config.distill.hidden_weight=0.1"],
                 id="distill")])
def test_gated_step_compiles_for_eight_devices(tmp_path, distill):
  out = tmp_path / "report.json"
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  env["XLA_FLAGS"] = helpers.xla_flags()    # the tool sets the device count itself
  done = subprocess.run(
      [sys.executable, "-m", "allatt_jax.compile_check",
       "--config=configs/wt103_prune.py:tiny", "--devices=8", "--mesh=2,4", f"--json={out}",
       *distill],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-5000:]
  kind = "gated, distilling" if distill else "gated"
  assert f"train step for 8 devices, mesh data=2 x model=4 ({kind})" in done.stdout
  report = json.loads(out.read_text())
  assert report["devices"] == 8 and report["mesh"] == [2, 4] and report["gated"]
  assert report["distills"] == bool(distill)
  assert report["params"] > 267_735           # the adaptive embedding alone has more
  # The step's arguments are the state shards plus two int32 token shards (batch 4
  # over data=2, 16 positions): nothing is replicated that the shardings split.
  tokens = 2 * (4 // 2) * 16 * 4
  assert report["memory"]["argument"] == report["state_bytes_per_device"] + tokens
  # The state is donated: its buffers are reused for the new state.
  assert report["memory"]["alias"] >= report["state_bytes_per_device"] * 0.99
  assert report["compile_s"] > 0 and report["flops_per_device"] > 0
  # The proxy per token: one device's counts over its share of the 4 x 16 tokens.
  proxy = report["proxy"]
  assert proxy["tokens"] == 4 * 16 / 8
  assert proxy["flops"] > proxy["matmul_flops"] > 0 and proxy["bytes"] > 0
  assert "per token" in done.stdout


def test_a_pipeline_compiles_both_stages(tmp_path):
  """The pruning stage's step is gated (over persistent groups here) and holds its
  teacher, a copy of the student's params: more state, more work a token."""
  out = tmp_path / "report.json"
  env = {**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": helpers.xla_flags()}
  done = subprocess.run(
      [sys.executable, "-m", "allatt_jax.compile_check", "--config=configs/demo.py:tiny",
       "--devices=4", "--mesh=2,2", f"--json={out}",
       "--config.pipeline.prune_gates.persistent_group=4"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-5000:]
  for stage, kind in (("baseline", "baseline"), ("pruning", "gated, distilling")):
    assert (f"configs/demo.py:tiny ({stage} stage): train step for 4 devices, mesh "
            f"data=2 x model=2 ({kind})") in done.stdout
  reports = json.loads(out.read_text())
  baseline, pruning = reports["baseline"], reports["pruning"]
  assert (baseline["gated"], baseline["distills"]) == (False, False)
  assert (pruning["gated"], pruning["distills"]) == (True, True)
  assert pruning["params"] == baseline["params"]
  # The teacher's params beside the student's params and its two Adam moments: a third
  # more (less the memory both states hold).
  assert pruning["state_bytes_per_device"] > 1.3 * baseline["state_bytes_per_device"]
  assert pruning["proxy"]["matmul_flops"] > 1.2 * baseline["proxy"]["matmul_flops"]
