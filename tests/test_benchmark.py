"""The benchmark CLI runs end to end at a tiny size (a smoke test: no timing asserted);
a config's benchmark section becomes its plan."""
import json
import pathlib
import subprocess
import sys

import pytest

from allatt_jax import config_base
from allatt_jax import resolver
from allatt_jax import throughput
from allatt_jax.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_plan_is_the_configs_benchmark_section_over_the_defaults():
  tiny = config_base.load(ROOT / "configs" / "bench_cpu.py", "tiny")
  assert throughput.BenchmarkPlan.from_dict(tiny.benchmark) == throughput.BenchmarkPlan(
      train_steps=1, eval_segments=1, rounds=1, heads_kept=(1.0, 0.5), matmul_size=256)
  assert throughput.BenchmarkPlan.from_dict({"rounds": 2}) == throughput.BenchmarkPlan(
      rounds=2)
  with pytest.raises(ConfigError, match=r"Unknown key --config\.benchmark\.round; known: "
                     "train_steps, "):
    throughput.BenchmarkPlan.from_dict({"round": 2})
  with pytest.raises(ConfigError, match=r"--config\.benchmark\.rounds is '3'; it takes int"):
    throughput.BenchmarkPlan.from_dict({"rounds": "3"})



def test_the_gpu_benchmark_times_the_paper_wt103_model_as_it_trains():
  gpu = config_base.load(ROOT / "configs" / "bench_gpu.py")
  paper = config_base.load(ROOT / "configs" / "wt103_base.py")
  assert gpu.model == paper.model and gpu.train == paper.train and gpu.mesh == paper.mesh
  assert throughput.BenchmarkPlan.from_dict(gpu.benchmark) == throughput.BenchmarkPlan(
      rounds=3, matmul_size=8192)
  resolver.resolve_config(gpu, vocab_from_data=True)   # its checks pass as it ships


@pytest.mark.slow   # trains a few steps in a process
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
