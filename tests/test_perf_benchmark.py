"""The benchmark CLI runs end to end at a tiny size (a smoke test: no timing asserted);
the rounds time every step and model in alternating order; the matmul peak and the
report's figures are the medians and ratios of the rounds' timings; a config's
benchmark section becomes its plan; variants are read from a config or from flags,
and a variant that overrides a key the config lacks fails before anything compiles."""
import dataclasses
import json
import pathlib
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from allatt_jax.perf import bench_report
from allatt_jax.perf import config_variants
from allatt_jax.config import config_base
from allatt_jax.pruning import cost_model
from allatt_jax.training import assembly
from allatt_jax.model import transformer as model_lib
from allatt_jax.perf import timing
from allatt_jax.config.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_plan_is_the_configs_benchmark_section_over_the_defaults():
  tiny = config_base.load(ROOT / "configs" / "bench_cpu.py", "tiny")
  assert timing.BenchmarkPlan.from_dict(tiny.benchmark) == timing.BenchmarkPlan(
      train_steps=1, eval_segments=1, rounds=1, heads_kept=(1.0, 0.5), matmul_size=256)
  assert timing.BenchmarkPlan.from_dict({"rounds": 2}) == timing.BenchmarkPlan(
      rounds=2)
  with pytest.raises(ConfigError, match=r"Unknown key --config\.benchmark\.round; known: "
                     "train_steps, "):
    timing.BenchmarkPlan.from_dict({"round": 2})
  with pytest.raises(ConfigError, match=r"--config\.benchmark\.rounds is '3'; it takes int"):
    timing.BenchmarkPlan.from_dict({"rounds": "3"})
  with pytest.raises(ConfigError, match=r"--config\.benchmark\.rounds is 0; it takes a count "
                     "of at least 1"):
    timing.BenchmarkPlan.from_dict({"rounds": 0})
  plan = timing.BenchmarkPlan.from_dict(
      {"profile": True, "variants": {"two": {"model": {"head_block": 2}}}})
  assert plan.profile and plan.variants == {"two": {"model": {"head_block": 2}}}
  with pytest.raises(ConfigError, match=r"--config\.benchmark\.variants is \{'two': 2\}; it "
                     "takes a dict"):
    timing.BenchmarkPlan.from_dict({"variants": {"two": 2}})


def test_variant_flags_add_to_the_configs_variants():
  variants = config_variants.from_flags(
      ["before:model.head_block=2,model.remat=False,model.dtype=bfloat16",
       "before:train.batch_size=4", "cut:model.cutoffs=(10, 20),model.heads_per_layer=[2,2]",
       "files:data.files='a.txt,b.txt,c.txt',data.name=text_files"],
      {"before": {"model": {"head_block": 4, "dropout": 0.0}}})
  assert variants == {
      "before": {"model": {"head_block": 2, "dropout": 0.0, "remat": False,
                           "dtype": "bfloat16"}, "train": {"batch_size": 4}},
      "cut": {"model": {"cutoffs": (10, 20), "heads_per_layer": [2, 2]}},
      "files": {"data": {"files": "a.txt,b.txt,c.txt", "name": "text_files"}}}
  assert config_variants.from_flags([], {"v": {"model": 3}}) == {"v": {"model": 3}}
  for bad in ("model.head_block=2", "before:head_block=2", "before:model.remat"):
    with pytest.raises(ConfigError, match=r"expected NAME:SECTION\.KEY=VALUE"):
      config_variants.from_flags([bad])


@pytest.fixture(scope="module")
def tiny_run():
  return assembly.with_vocab_size(assembly.checked_config(
      config_base.load(ROOT / "configs" / "bench_cpu.py", "tiny")))


def test_a_variant_is_the_config_with_its_overrides(tiny_run):
  variants = config_variants.resolve(tiny_run, {
      "two": {"model": {"head_block": 2.0, "remat": False, "dropout": 0}},
      "cut": {"model": {"heads_per_layer": [2, 4]},
              "train": {"batch_size": 4, "weight_decay_exclude": ["norm"]}}})
  two, cut = variants["two"], variants["cut"]
  assert (two.model.head_block, two.model.remat, two.model.dropout) == (2, False, 0.0)
  assert isinstance(two.model.head_block, int) and isinstance(two.model.dropout, float)
  assert cut.train.weight_decay_exclude == ("norm",)
  assert two.train == tiny_run.train and two.eval == tiny_run.eval
  assert cut.model.heads_per_layer == (2, 4) and cut.train.batch_size == 4
  assert cut.model.head_block == tiny_run.model.head_block


@pytest.mark.slow   # compiles three train steps: 20 s on 2 cores
def test_a_variant_that_holds_what_the_config_holds_starts_from_a_copy_of_its_state(
    tiny_run, monkeypatch):
  """Its initialiser is not compiled: the baseline's state is copied, where every
  leaf's shape, dtype and sharding agree; a variant of other shapes initialises."""
  variants = config_variants.resolve(tiny_run, {
      "two": {"model": {"head_block": 2, "remat": False}},
      "cut": {"model": {"heads_per_layer": [2, 4]}}})
  base = timing.TrainStep(tiny_run, gated=False)
  initialised, copied = [], []
  new_state = assembly.RunSetup.new_state
  monkeypatch.setattr(assembly.RunSetup, "new_state",
                      lambda self: initialised.append(1) or new_state(self))
  monkeypatch.setattr(timing.TrainStep, "run",   # the state as the step gets it
                      lambda self, n: copied.append(jax.tree.map(np.array, self._state)))
  base_state = jax.tree.map(np.array, base._state)
  same = timing.TrainStep(variants["two"], gated=False, like=base)
  assert not initialised
  jax.tree.map(np.testing.assert_array_equal, copied[0], base_state)
  assert not any(a is b for a, b in zip(jax.tree.leaves(base._state),
                                        jax.tree.leaves(same._state)))
  other = timing.TrainStep(variants["cut"], gated=False, like=base)
  assert initialised == [1]
  assert [x.shape for x in jax.tree.leaves(other._state)] != [
      x.shape for x in jax.tree.leaves(base._state)]


@pytest.mark.slow
def test_each_round_hands_over_the_report_of_the_rounds_so_far(tiny_run):
  """A benchmark stopped at a time limit keeps the rounds it finished: the report
  after round i holds i rounds, and the last is the returned report (no profile)."""
  plan = timing.BenchmarkPlan(train_steps=1, eval_segments=1, rounds=2, heads_kept=(1.0,),
                              matmul_size=64, gated_steps=False)
  reports = []
  final = timing.measure(tiny_run, plan, on_round=reports.append)
  assert [r["rounds_done"] for r in reports] == [1, 2]
  assert [len(r["train"]["baseline"]["step_s_rounds"]) for r in reports] == [1, 2]
  assert [len(r["matmul"]["gflops_per_s_rounds"]) for r in reports] == [1, 2]
  assert reports[0]["inference"][0]["tokens_per_s"] > 0
  assert reports[-1] == final


@pytest.mark.slow   # compiles three train steps and an evaluation
def test_a_pipeline_config_times_its_pruning_stage_as_it_trains():
  """The gated and distilling steps are the pruning stage's (its gates over persistent
  groups, its distillation, its batch), named in the summary; a stage that does not
  distill has the benchmark's own distillation timed, and the summary says so."""
  config = config_base.load(ROOT / "configs" / "demo.py", "tiny")
  config.pipeline.prune_gates.persistent_group = 4
  config.pipeline.prune_train.batch_size = 8
  stages = assembly.pipeline_with_vocab_size(assembly.checked_pipeline(config))
  assert stages.pruning.model == stages.baseline.model
  plan = timing.BenchmarkPlan(train_steps=1, eval_segments=1, rounds=1, heads_kept=(1.0,),
                              matmul_size=64)
  report = timing.measure(stages.baseline, plan, pruning=stages.pruning)
  train = report["train"]
  assert train["pruning_stage"] and not train["distill_is_benchmarks"]
  assert train["gates_settings"] == {**stages.pruning.gates.to_dict(), "enabled": True}
  assert train["gates_settings"]["persistent_group"] == 4
  assert train["distill_settings"] == stages.pruning.distill.to_dict()
  assert train["distill_settings"]["kl_clusters"] == "head"
  assert train["distill_settings"]["hidden_weight"] == 0.0
  # Per token: the pruning stage trains 8 rows a step, the baseline 4.
  assert train["gated"]["tokens_per_s"] == pytest.approx(8 * 16 / train["gated"]["step_s"])
  assert train["baseline"]["tokens_per_s"] == pytest.approx(
      4 * 16 / train["baseline"]["step_s"])
  assert train["gated_overhead"] == pytest.approx(
      train["baseline"]["tokens_per_s"] / train["gated"]["tokens_per_s"] - 1)
  lines = bench_report.summary(report).splitlines()
  assert (f"gated step overhead {train['gated_overhead']:+.1%} per token (the pipeline's "
          "pruning stage: heads and groups of 4 persistent slots)") in lines
  distilling = next(line for line in lines if line.startswith("distilling step"))
  assert distilling.endswith("(the pipeline's pruning stage: weight=0.5, temperature=1, "
                             "hidden_weight=0, kl_clusters=head)")
  train.update(distill_is_benchmarks=True, distill_settings=timing.DISTILL | {
      "kl_clusters": "all"})
  distilling = next(line for line in bench_report.summary(report).splitlines()
                    if line.startswith("distilling step"))
  assert distilling.endswith("(the benchmark's own: the pipeline's pruning stage does not "
                             "distill: weight=0.5, temperature=1, hidden_weight=0.1, "
                             "kl_clusters=all)")


@pytest.mark.parametrize("overrides, message", [
    ({"model": {"head_blocks": 2}},
     r"^Variant 'v': the config has no model\.head_blocks; did you mean model\.head_block\? "
     r"A variant overrides keys the config has\.$"),
    ({"benchmark": {"rounds": 1}}, r"^Variant 'v': 'benchmark' is no section of a run "
     r"config; a variant overrides \{section: \{key: value\}\} of model, gates, data"),
    ({"model": 3}, r"^Variant 'v': its model is 3; give the keys it overrides, e\.g\. "
     r"model=dict\(KEY=VALUE\)\.$"),
    ({"model": {"remat": "yes"}},
     r"^Variant 'v': model\.remat='yes', but the config's value is True: give a bool\.$"),
    ({"model": {"head_block": 1.5}}, r"model\.head_block=1\.5, but .* give a int"),
    ({"model": {"kind": "lstm"}},
     r"^Variant 'v': config\.model\.kind='lstm' is unknown; choose one of"),
])
def test_a_bad_variant_is_a_one_line_config_error(tiny_run, overrides, message):
  with pytest.raises(ConfigError, match=message) as error:
    config_variants.resolve(tiny_run, {"v": overrides})
  assert "\n" not in str(error.value)


def test_the_benchmark_refuses_an_unknown_override_before_compiling():
  done = subprocess.run([sys.executable, "-m", "allatt_jax.benchmark",
                         "--config=configs/bench_cpu.py:tiny",
                         "--variant=before:model.head_blocks=2"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert done.returncode == 2
  assert done.stderr == ("error: Variant 'before': the config has no model.head_blocks; "
                         "did you mean model.head_block? A variant overrides keys the "
                         "config has.\n")



def test_the_gpu_benchmark_times_the_paper_wt103_model_as_it_trains():
  gpu = config_base.load(ROOT / "configs" / "bench_gpu.py")
  paper = config_base.load(ROOT / "configs" / "wt103_base.py")
  assert gpu.model == paper.model and gpu.train == paper.train and gpu.mesh == paper.mesh
  # Inference at the training batch, where the GPU is busy; the rest as it evaluates.
  assert gpu.eval.to_dict() == {**paper.eval.to_dict(), "batch_size": paper.train.batch_size}
  plan = timing.BenchmarkPlan.from_dict(gpu.benchmark)
  assert dataclasses.replace(plan, variants={}) == timing.BenchmarkPlan(
      rounds=3, matmul_size=8192, variants={})
  # Beside the code as it is, the code before the accelerator rewrite, and the split core.
  variants = config_variants.resolve(assembly.checked_config(gpu), plan.variants)
  assert list(variants) == ["before", "split"]
  before = variants["before"].model
  assert (before.vocab_block, before.tail_capacity, before.score_dtype,
          before.attention_impl) == (8192, 0.0, "float32", "xla")
  split = variants["split"].model
  assert (split.attention_impl, split.persistent_impl) == ("split", "auto")
  # With dropout, as it trains, "auto" is the XLA core on every device (core_choice).
  assert assembly.checked_config(paper).model.attention_impl == "auto"
  assembly.checked_config(gpu)   # its checks pass as it ships
  # What a 10-minute command on a lent GPU can time: the model as it trains, fewer steps.
  lease = config_base.load(ROOT / "configs" / "bench_gpu.py", "lease")
  assert lease.model == gpu.model and lease.train == gpu.train and lease.eval == gpu.eval
  assert timing.BenchmarkPlan.from_dict(lease.benchmark) == timing.BenchmarkPlan(
      rounds=2, matmul_size=8192, heads_kept=(1.0, 0.5), gated_steps=False,
      variant_evaluations=False, variants={"split": plan.variants["split"]})


@pytest.mark.slow   # trains a few steps in a process
def test_benchmark_cli_writes_a_complete_report(tmp_path):
  out = tmp_path / "bench.json"
  done = subprocess.run([sys.executable, "-m", "allatt_jax.benchmark",
                         "--config=configs/bench_cpu.py:tiny", f"--out={out}", "--profile",
                         "--variant=two_heads:model.head_block=2,model.remat=False"],
                        cwd=ROOT, check=True, capture_output=True, text=True)
  report = json.loads(out.read_text())
  assert report["rounds_done"] == 1   # bench_cpu.py:tiny's rounds, all done
  for name in ("baseline", "gated", "distill"):
    step = report["train"][name]
    assert step["tokens_per_s"] > 0 and step["compile_s"] > 0
    assert 0 < step["fraction_of_matmul_peak"]
  # bench_cpu.py leaves distillation off: the benchmark times its own.
  assert report["train"]["distill_settings"]["weight"] == 0.5
  train = report["train"]
  assert train["distill_overhead"] == pytest.approx(
      train["distill"]["step_s"] / train["gated"]["step_s"] - 1)
  assert train["distill_temp_ratio"] == pytest.approx(
      train["distill"]["xla_temp_bytes"] / train["gated"]["xla_temp_bytes"])
  # The teacher's forward pass and the KL are work the gated step does not do.
  assert train["distill"]["proxy"]["flops"] > 1.2 * train["gated"]["proxy"]["flops"]
  assert report["matmul"]["gflops_per_s"] > 0
  kept = [r["heads_kept"] for r in report["inference"]]
  assert kept == [1.0, 0.5]
  full, half = report["inference"]
  assert full["mac_ratio"] == 1.0 and full["heads_per_layer"] == [4, 4]
  assert half["heads_per_layer"] == [2, 2] and 0.5 < half["mac_ratio"] < 1.0
  assert all(r["tokens_per_s"] > 0 for r in report["inference"])
  assert report["memory"]["peak_rss_bytes"] > 0
  # Proxy figures of every train step; the baseline's profile; the variant beside it.
  for name in ("baseline", "gated", "distill"):
    proxy = report["train"][name]["proxy"]
    assert proxy["flops"] > proxy["matmul_flops"] > 0 and proxy["bytes"] > 0
    assert proxy["tokens"] == 2 * 8 and proxy["loops"] > 0
  profile = report["train"]["baseline"]["profile"]
  assert profile["attributed"] and profile["kernel_ms_per_step"] > 0
  assert profile["parts"]["attention"]["ms_per_step"] > 0
  variant = report["variants"]["two_heads"]
  assert variant["overrides"] == {"model": {"head_block": 2, "remat": False}}
  assert variant["train"]["tokens_per_s"] > 0 and variant["eval"]["tokens_per_s"] > 0
  assert variant["train_tokens_per_s_ratio"] == pytest.approx(
      variant["train"]["tokens_per_s"] / report["train"]["baseline"]["tokens_per_s"])
  assert variant["eval_tokens_per_s_ratio"] == pytest.approx(
      variant["eval"]["tokens_per_s"] / full["tokens_per_s"])
  assert variant["train"]["xla_temp_bytes"] > 0 and variant["train"]["profile"]["attributed"]
  assert variant["eval"]["proxy"]["matmul_flops"] == pytest.approx(
      full["proxy"]["matmul_flops"])   # the same model, its heads in blocks of 2
  assert full["proxy_bytes_ratio"] == 1 and 0.5 < half["proxy_bytes_ratio"] < 1
  assert len(variant["train"]["step_s_rounds"]) == 1   # timed in the config's round
  assert "variant two_heads: train" in done.stdout and "profile (cpu" in done.stdout


class _Step(types.SimpleNamespace):
  __hash__ = object.__hash__   # the report keys its rounds by step, as TrainStep's


def _timed_as(config, *, walls, gated_walls, distill_walls, eval_rates, peaks):
  """A benchmark's rounds as `bench_report.build` reads them, with these timings: train
  steps timed 2 steps a round, `eval_rates` the tokens/s of the models of 4, then 2,
  heads a layer, matmul `peaks` (GFLOP per wall and per CPU second) a round."""
  cfg = model_lib.ModelConfig.from_config(config, gated=False)

  def step(config, walls, **extra):
    usages = [types.SimpleNamespace(wall=w, cpu=2 * w, faults=10) for w in walls]
    train = config.train
    return _Step(
        config=config, lm=types.SimpleNamespace(cfg=cfg), compile_s=1.5,
        tokens_per_step=train.batch_size * train.seq_len, temp_bytes=lambda: 1000,
        proxy={"flops": 2e6, "matmul_flops": 1e6, "bytes": 3e6,
               "parts": {part: {"flops": 1e5, "bytes": 2e5}
                         for part in ("output_layer", "attention")}}, usages=usages, own_distill=False, **extra)

  def model(heads, rate, proxy_bytes, segment_s_rounds=(0.1, 0.2, 0.4)):
    return types.SimpleNamespace(
        heads_kept=heads / 4, cfg=dataclasses.replace(cfg, heads_per_layer=(heads, heads)),
        figures=lambda: {"tokens_per_s": rate, "compile_s": 0.5,
                         "segment_s_rounds": list(segment_s_rounds),
                         "proxy": {"bytes": proxy_bytes}})

  steps = {"baseline": step(config, walls), "gated": step(config, gated_walls),
           "distill": step(config, distill_walls)}
  # Variant "two": its train step at 0.4, 0.6 and 1.2 s a round (its median twice the
  # baseline's); its model at half the full model's rate, its rounds' seconds 4, 2 and
  # 1 times the full model's.
  variant = (step(config, [0.4, 0.6, 1.2]),
             model(4, eval_rates[0] / 2, 100.0, segment_s_rounds=(0.4, 0.4, 0.4)))
  timed = bench_report.Timed(
      config=config, plan=timing.BenchmarkPlan(
          train_steps=2, variants={"two": {"model": {"head_block": 2}}}),
      train_steps=steps,
      models=[model(4, eval_rates[0], 100.0), model(2, eval_rates[1], 60.0)],
      variants={"two": variant}, load_before=(0.5, 0.5, 0.5), peaks=peaks)
  for s in (*steps.values(), variant[0]):
    timed.usages[s], timed.first_steps[s] = s.usages, [2.0]
  return timed, cfg


def test_the_report_is_the_medians_of_its_rounds_and_their_ratios(tiny_run):
  timed, cfg = _timed_as(tiny_run, walls=[0.2, 0.4, 0.3], gated_walls=[0.5, 0.5, 0.5],
                         distill_walls=[0.6, 0.7, 0.8], eval_rates=(1000.0, 1600.0),
                         peaks=[(100.0, 40.0), (120.0, 50.0), (80.0, 60.0)])
  report = bench_report.build(timed)
  train, (full, half) = report["train"], report["inference"]
  t = tiny_run.train
  tokens = t.batch_size * t.seq_len
  flops = 6 * cost_model.macs_per_token(cfg, t.seq_len, t.mem_len,
                                        t.batch_size)["macs_per_token"]
  base = train["baseline"]
  # Per step: the median round's 0.3 s over its 2 steps, and twice that of CPU.
  assert base["step_s"] == pytest.approx(0.15) and base["cpu_s_per_step"] == pytest.approx(0.3)
  assert base["step_s_rounds"] == pytest.approx([0.1, 0.2, 0.15])
  assert base["tokens_per_s"] == pytest.approx(tokens / 0.15)
  assert report["matmul"]["gflops_per_s"] == 100.0 and report["matmul"]["gflop_per_cpu_s"] == 50.0
  assert base["model_gflops_per_s"] == pytest.approx(flops * tokens / 0.15 / 1e9)
  assert base["fraction_of_matmul_peak"] == pytest.approx(flops * tokens / 0.15 / 1e9 / 100)
  assert base["fraction_of_matmul_peak_per_cpu_s"] == pytest.approx(
      flops * tokens / 0.3 / 1e9 / 50)
  assert base["minor_page_faults_per_step"] == 5 and base["first_step_in_round_s"] == 2.0
  # The gated step against the baseline, the distilling one against the gated one.
  assert train["gated_overhead"] == pytest.approx(0.25 / 0.15 - 1)
  assert train["distill_overhead"] == pytest.approx(0.35 / 0.25 - 1)
  # Half the heads: the speed-up against the MACs' ideal one.
  mac_ratio = half["macs_per_token"] / full["macs_per_token"]
  assert full["speedup"] == 1.0 and full["mac_ratio"] == 1.0
  assert half["speedup"] == pytest.approx(1.6) and half["heads_per_layer"] == [2, 2]
  assert half["ideal_speedup"] == pytest.approx(1 / mac_ratio) and mac_ratio < 1
  assert half["speedup_fraction_of_ideal"] == pytest.approx(1.6 * mac_ratio)
  assert half["proxy_bytes_ratio"] == pytest.approx(0.6)
  two = report["variants"]["two"]
  assert two["overrides"] == {"model": {"head_block": 2}}
  assert two["train"]["step_s"] == pytest.approx(0.3)
  assert two["train_tokens_per_s_ratio"] == pytest.approx(0.5)
  assert two["eval_tokens_per_s_ratio"] == pytest.approx(0.5)
  # Each round's ratio: train 0.1/0.2, 0.2/0.3, 0.15/0.6 a step, eval 0.25, 0.5, 1.
  assert two["train_ratio_quartiles"] == pytest.approx([0.375, 7 / 12])
  assert two["eval_ratio_quartiles"] == pytest.approx([0.375, 0.75])
  lines = bench_report.summary(report).splitlines()
  assert any(line.startswith(
      f"variant two: train {tokens / 0.3:,.0f} tokens/s = x0.500 (rounds' middle half "
      "x0.375-x0.583) of the config's, eval (all heads) 500 tokens/s = x0.500 (rounds' "
      "middle half x0.375-x0.750)") for line in lines), lines
  assert f"gated step overhead {0.25 / 0.15 - 1:+.1%} per token" in "\n".join(lines)
  # A variant whose evaluation the plan leaves out (variant_evaluations=False).
  timed.variants["two"] = (timed.variants["two"][0], None)
  two = bench_report.build(timed)["variants"]["two"]
  assert two["eval"] is None and two["eval_tokens_per_s_ratio"] is None
  assert two["train_tokens_per_s_ratio"] == pytest.approx(0.5)
  assert "of the config's, eval not timed;" in bench_report.summary(
      bench_report.build(timed))
  assert any(line.startswith("eval  50% heads      1600 tokens/s") and
             f"speed-up 1.60 of ideal {1 / mac_ratio:.2f} ({1.6 * mac_ratio:.0%})" in line
             for line in lines), lines


def test_the_timed_pruned_models_keep_the_fraction_of_heads_in_every_layer(tiny_run):
  cfg, variables = timing.random_model(tiny_run)
  assert all(np.std(np.asarray(leaf)) == pytest.approx(0.02, rel=0.2)
             for leaf in jax.tree.leaves(variables["params"]) if np.size(leaf) > 100)
  for kept, removed in ((1.0, 0), (0.75, 1), (0.5, 2), (0.25, 3)):
    heads = timing.removed_heads(cfg, kept)
    assert sorted(heads) == list(range(cfg.num_layers))
    for layer, gone in heads.items():
      assert len(set(gone)) == removed and set(gone) <= set(range(cfg.layer_heads[layer]))
  assert timing.removed_heads(cfg, 0.5) == timing.removed_heads(cfg, 0.5)   # one seed


def test_the_rounds_alternate_their_order_and_start_each_step_untimed(tiny_run, monkeypatch):
  """`timing.measure` with its timed parts recorded instead of compiled: the gated and
  distilling steps are the pruning run's, each round runs every step once untimed
  before its timed steps and reverses the order of the round before, and the profile
  traces the baseline step and each variant's."""
  ran, built = [], {}

  class Step:
    compiled, compile_s = types.SimpleNamespace(as_text=lambda: ""), 0.0

    def __init__(self, config, *, gated, distill=False, like=None):
      self.config, self.like = config, like
      self.name = ("distill" if distill else "gated" if gated else "baseline") + (
          "-variant" if like else "")
      built[self.name] = self

    def run(self, num_steps):
      ran.append((self.name, num_steps))
      return types.SimpleNamespace(wall=0.1 * num_steps)

  class Model:
    compile_s = 0.0

    def __init__(self, config, model, heads_kept, segments):
      self.name, self.seconds = f"eval {heads_kept}" + (
          "-variant" if config != tiny_run else ""), []

    def warm(self):
      ran.append((self.name, "warm"))

    def run(self):
      ran.append((self.name, "timed"))
      return 0.5

  monkeypatch.setattr(timing, "TrainStep", Step)
  monkeypatch.setattr(timing, "Inference", Model)
  monkeypatch.setattr(timing, "random_model", lambda config: None)
  monkeypatch.setattr(timing, "Matmul", lambda n, dtype: types.SimpleNamespace(
      gflops=lambda: (100.0, 50.0)))
  monkeypatch.setattr(bench_report, "build", lambda timed: timed)
  profiled = []
  monkeypatch.setattr(timing.step_profile, "profile",
                      lambda run, hlo, steps: profiled.append(run.__self__.name))
  pruning = dataclasses.replace(tiny_run, train=dataclasses.replace(tiny_run.train,
                                                                    batch_size=8))
  plan = timing.BenchmarkPlan(train_steps=3, rounds=2, heads_kept=(1.0, 0.5), profile=True,
                              variants={"v": {"model": {"head_block": 2}}})
  rounds_handed = []
  timed = timing.measure(tiny_run, plan, pruning=pruning,
                         on_round=lambda report: rounds_handed.append(len(report.peaks)))
  assert rounds_handed == [1, 2]
  assert [m.seconds for m in timed.models] == [[0.5, 0.5]] * 2
  assert built["baseline"].config == tiny_run
  assert built["gated"].config == pruning != tiny_run and built["distill"].config == pruning
  assert built["baseline-variant"].like is built["baseline"]
  steps = ["baseline", "gated", "distill", "baseline-variant"]
  models = ["eval 1.0", "eval 0.5", "eval 1.0-variant"]

  def round_of(steps, models):
    return ([(s, n) for s in steps for n in (1, 3)]
            + [(m, k) for m in models for k in ("warm", "timed")])
  assert ran == round_of(steps, models) + round_of(steps[::-1], models[::-1])
  assert [len(timed.first_steps[built[s]]) for s in steps] == [2] * 4
  assert [len(timed.usages[built[s]]) for s in steps] == [2] * 4
  assert timed.peaks == [(100.0, 50.0)] * 2
  assert profiled == ["baseline", "baseline-variant"]


def test_the_matmul_peak_is_its_fastest_run(monkeypatch):
  """2n³ FLOP over the fastest run's wall and over that run's CPU seconds (user and
  system, all threads); a block's usage is what it added to the process's."""
  matmul = timing.Matmul(8)
  samples = iter([(0.0, 0.0, 0), (1.0, 0.5, 3),     # (user, system, minor faults)
                  (1.0, 0.5, 3), (1.2, 0.6, 4),
                  (1.2, 0.6, 4), (1.5, 0.7, 4),
                  (2.0, 1.0, 10), (2.5, 1.25, 17)])
  monkeypatch.setattr(timing, "resource", types.SimpleNamespace(
      RUSAGE_SELF=0, getrusage=lambda who: types.SimpleNamespace(
          **dict(zip(("ru_utime", "ru_stime", "ru_minflt"), next(samples))))))
  clock = iter([0.0, 0.3, 1.0, 1.1, 2.0, 2.2, 3.0, 3.5])   # walls 0.3, 0.1, 0.2; 0.5
  monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
  flops = 2 * 8 ** 3 / 1e9
  assert matmul.gflops() == pytest.approx((flops / 0.1, flops / 0.3))
  with timing._Usage() as usage:   # pylint: disable=protected-access
    pass
  assert (usage.wall, usage.cpu, usage.faults) == pytest.approx((0.5, 0.75, 7))
