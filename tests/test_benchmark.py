"""The benchmark CLI runs end to end at a tiny size (a smoke test: no timing asserted)."""
import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow   # every test here trains runs or starts processes

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_benchmark_cli_writes_a_complete_report(tmp_path):
  out = tmp_path / "bench.json"
  subprocess.run([sys.executable, "-m", "allatt_jax.benchmark",
                  "--config=configs/bench_cpu.py:tiny", f"--out={out}"],
                 cwd=ROOT, check=True, capture_output=True, text=True)
  report = json.loads(out.read_text())
  for name in ("baseline", "gated", "distill"):
    step = report["train"][name]
    assert step["tokens_per_s"] > 0 and step["compile_s"] > 0
    assert 0 < step["fraction_of_matmul_peak"]
  # bench_cpu.py leaves distillation off: the benchmark times its own.
  assert report["train"]["distill_settings"]["weight"] == 0.5
  assert report["train"]["distill_overhead"] > -1 and report["train"]["distill_temp_ratio"] > 0
  assert report["matmul"]["gflops_per_s"] > 0
  kept = [r["heads_kept"] for r in report["inference"]]
  assert kept == [1.0, 0.5]
  full, half = report["inference"]
  assert full["mac_ratio"] == 1.0 and full["heads_per_layer"] == [4, 4]
  assert half["heads_per_layer"] == [2, 2] and 0.5 < half["mac_ratio"] < 1.0
  assert all(r["tokens_per_s"] > 0 for r in report["inference"])
  assert report["memory"]["peak_rss_bytes"] > 0
