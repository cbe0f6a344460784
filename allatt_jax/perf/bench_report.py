"""The benchmark's report: built from what `timing.measure` timed so far (`build`),
and as a few human-readable lines (`summary`)."""
import dataclasses
import os
import resource
import statistics
from typing import Any

import jax

from allatt_jax.perf import config_variants
from allatt_jax.pruning import cost_model
from allatt_jax.perf import step_profile


@dataclasses.dataclass
class Timed:
  """What the benchmark built (`timing.TrainStep`s and `timing.Inference`s: the config's
  train steps by name, its models by fraction of heads kept, each variant's train step
  and evaluation) and what its rounds measured of them so far."""
  config: Any                        # the run config, with its vocabulary size
  plan: Any                          # timing.BenchmarkPlan
  train_steps: dict                  # name -> TrainStep
  models: list                       # Inference, one per plan.heads_kept
  variants: dict                     # name -> (TrainStep, Inference or None)
  load_before: tuple[float, float, float]
  pruning_stage: bool = False        # the gated steps are a pipeline's pruning stage's
  peaks: list[tuple[float, float]] = dataclasses.field(default_factory=list)
  usages: dict = dataclasses.field(default_factory=dict)        # step -> [timed usage]
  first_steps: dict = dataclasses.field(default_factory=dict)   # step -> [seconds]
  profiles: dict = dataclasses.field(default_factory=dict)      # step -> step_profile's

  def __post_init__(self):
    for step in (*self.train_steps.values(), *(s for s, _ in self.variants.values())):
      self.usages.setdefault(step, [])
      self.first_steps.setdefault(step, [])


def _median(values):
  return float(statistics.median(values))


def _train_entry(timed: Timed, step, peaks: tuple[float, float]) -> dict:
  """A train step's figures: medians of its rounds, model GFLOP/s against the matmul
  `peaks` (per wall and per CPU second), its compiled form's proxy figures and, where
  traced, its profile."""
  train, cfg, steps = step.config.train, step.lm.cfg, timed.plan.train_steps
  usages = timed.usages[step]
  flops_per_token = 6 * cost_model.macs_per_token(
      cfg, train.seq_len, train.mem_len, train.batch_size)["macs_per_token"]
  per_step = lambda attr: _median(getattr(u, attr) / steps for u in usages)
  seconds, cpu_seconds = per_step("wall"), per_step("cpu")
  gflops = flops_per_token * step.tokens_per_step / seconds / 1e9
  gflop_per_cpu_s = flops_per_token * step.tokens_per_step / cpu_seconds / 1e9
  return {
      "step_s": seconds, "tokens_per_s": step.tokens_per_step / seconds,
      "compile_s": step.compile_s, "first_step_in_round_s": _median(timed.first_steps[step]),
      "model_flops_per_token": flops_per_token,
      "model_gflops_per_s": gflops, "fraction_of_matmul_peak": gflops / peaks[0],
      "cpu_s_per_step": cpu_seconds,
      "fraction_of_matmul_peak_per_cpu_s": gflop_per_cpu_s / peaks[1],
      "minor_page_faults_per_step": per_step("faults"),
      "step_s_rounds": [u.wall / steps for u in usages],
      "xla_temp_bytes": step.temp_bytes(), "proxy": step.proxy,
      **({"profile": timed.profiles[step]} if step in timed.profiles else {})}


def _train_report(timed: Timed, peaks: tuple[float, float]) -> dict:
  """The config's train steps, and the gated and distilling steps' overheads (per
  token: a pipeline's pruning stage may train at another batch size), with the
  settings they ran."""
  report = {name: _train_entry(timed, step, peaks) for name, step in timed.train_steps.items()}
  report["flops_per_token"] = report["baseline"]["model_flops_per_token"]
  if "gated" in report:
    distilled, gated = report["distill"], report["gated"]
    distill_step = timed.train_steps["distill"]
    report["gated_overhead"] = report["baseline"]["tokens_per_s"] / gated["tokens_per_s"] - 1
    report["pruning_stage"] = timed.pruning_stage
    report["gates_settings"] = timed.train_steps["gated"].config.gates.to_dict()
    report["distill_settings"] = distill_step.config.distill.to_dict()
    report["distill_is_benchmarks"] = distill_step.own_distill
    report["distill_overhead"] = gated["tokens_per_s"] / distilled["tokens_per_s"] - 1
    if distilled["xla_temp_bytes"] and gated["xla_temp_bytes"]:
      report["distill_temp_ratio"] = distilled["xla_temp_bytes"] / gated["xla_temp_bytes"]
  return report


def _inference_report(timed: Timed, cfg) -> list[dict]:
  """Each model's evaluation speed, against the ideal speed-up of its MACs to those of
  `cfg`, the config's model with all its heads."""
  e = timed.config.eval
  macs = lambda model_cfg: cost_model.macs_per_token(
      model_cfg, e.seq_len, e.mem_len, e.batch_size)["macs_per_token"]
  inference = []
  for model in timed.models:
    figures = model.figures()
    first = inference[0] if inference else figures   # the first fraction's, all heads
    mac_ratio = macs(model.cfg) / macs(cfg)
    speedup = figures["tokens_per_s"] / first["tokens_per_s"]
    inference.append({
        "heads_kept": model.heads_kept, "heads_per_layer": list(model.cfg.layer_heads),
        **figures, "macs_per_token": macs(model.cfg), "mac_ratio": mac_ratio,
        "proxy_bytes_ratio": figures["proxy"]["bytes"] / first["proxy"]["bytes"],
        "speedup": speedup, "ideal_speedup": 1 / mac_ratio,
        "speedup_fraction_of_ideal": speedup * mac_ratio})
  return inference


def build(timed: Timed) -> dict:
  """The report of what `timed` measured: its rounds so far (at least one), and the
  profiles of the steps traced."""
  config, train = timed.config, timed.config.train
  peak, peak_cpu = (_median(p[i] for p in timed.peaks) for i in (0, 1))
  train_report = _train_report(timed, (peak, peak_cpu))
  cfg = timed.train_steps["baseline"].lm.cfg
  inference = _inference_report(timed, cfg)
  full = next((r for r in inference if r["heads_kept"] == 1.0), None)
  variants = {
      name: config_variants.entry(timed.plan.variants[name],
                                  _train_entry(timed, step, (peak, peak_cpu)),
                                  evaluation and evaluation.figures(),
                                  train_report["baseline"], full)
      for name, (step, evaluation) in timed.variants.items()}
  return {
      "device": str(jax.devices()[0].device_kind), "platform": jax.default_backend(),
      "num_devices": jax.device_count(), "jax_version": jax.__version__,
      "rounds_done": len(timed.peaks),
      "model": {"kind": cfg.kind, "num_layers": cfg.num_layers, "d_model": cfg.d_model,
                "num_heads": cfg.num_heads, "num_persistent": cfg.num_persistent,
                "vocab_size": cfg.vocab_size, "dtype": cfg.dtype,
                "head_block": cfg.head_block, "remat": cfg.remat,
                "batch_size": train.batch_size, "seq_len": train.seq_len,
                "mem_len": train.mem_len},
      "matmul": {"n": timed.plan.matmul_size, "dtype": config.model.dtype,
                 "gflops_per_s": peak, "gflop_per_cpu_s": peak_cpu,
                 "gflops_per_s_rounds": [p[0] for p in timed.peaks]},
      "train": train_report,
      "inference": inference,
      "variants": variants,
      "memory": {"peak_rss_bytes": _rss_peak_bytes(), "device": _device_memory()},
      "environment": {"load_average_before": timed.load_before,
                      "load_average_after": os.getloadavg(),
                      "cpu_count": os.cpu_count(),
                      **{k: os.environ.get(k) for k in ("GLIBC_TUNABLES", "XLA_FLAGS")}},
  }


def _gates_timed(train: dict) -> str:
  """What the gated step gates, and whose settings those are."""
  gates = train["gates_settings"]
  group = gates["persistent_group"]
  kinds = [*(["heads"] if gates["heads"] else []),
           *([f"groups of {group} persistent slots"] if group else [])]
  whose = "the pipeline's pruning stage" if train["pruning_stage"] else "the config's gates"
  return f"{whose}: {' and '.join(kinds)}"


def _distill_timed(train: dict) -> str:
  """The distilling step's settings, and whose they are."""
  d = train["distill_settings"]
  if train["distill_is_benchmarks"]:
    whose = ("the benchmark's own: the pipeline's pruning stage does not distill"
             if train["pruning_stage"] else "the benchmark's own: the config does not distill")
  else:
    whose = "the pipeline's pruning stage" if train["pruning_stage"] else "the config's"
  return f"{whose}: " + ", ".join(f"{key}={value:g}" if isinstance(value, float)
                                   else f"{key}={value}" for key, value in d.items())


def _rss_peak_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB


def _device_memory() -> dict | None:
  stats = jax.devices()[0].memory_stats()
  if not stats:
    return None
  return {k: stats[k] for k in ("peak_bytes_in_use", "bytes_limit") if k in stats}


def summary(report: dict) -> str:
  """A few human-readable lines of the report."""
  t = report["train"]
  env = report["environment"]
  lines = [f"matmul peak {report['matmul']['gflops_per_s']:.0f} GFLOP/s "
           f"({report['platform']}, load {env['load_average_before'][0]:.1f} before, "
           f"{env['load_average_after'][0]:.1f} after)"]
  for name in ("baseline", "gated", "distill"):
    if name not in t:   # the plan's gated_steps=False
      continue
    r = t[name]
    lines.append(f"train {name:8s} {r['tokens_per_s']:9.0f} tokens/s  {r['step_s']:.3f} s/step"
                 f"  {r['model_gflops_per_s']:.0f} GFLOP/s = "
                 f"{r['fraction_of_matmul_peak']:.0%} of peak "
                 f"({r['fraction_of_matmul_peak_per_cpu_s']:.0%} per CPU second)  "
                 f"compile {r['compile_s']:.1f} s")
  lines += _proxy(t["baseline"]["proxy"])
  lines += step_profile.summary(t["baseline"]["profile"]) if "profile" in t["baseline"] else []
  if "gated_overhead" in t:
    lines.append(f"gated step overhead {t['gated_overhead']:+.1%} per token "
                 f"({_gates_timed(t)})")
    lines.append(f"distilling step against the gated one: {t['distill_overhead']:+.1%} "
                 f"time per token, XLA temporaries "
                 f"x{t.get('distill_temp_ratio', float('nan')):.2f} ({_distill_timed(t)})")
  for r in report["inference"]:
    lines.append(f"eval {r['heads_kept']:4.0%} heads {r['tokens_per_s']:9.0f} tokens/s  "
                 f"MACs x{r['mac_ratio']:.2f} (bytes x{r['proxy_bytes_ratio']:.2f})  "
                 f"speed-up {r['speedup']:.2f} of ideal {r['ideal_speedup']:.2f} "
                 f"({r['speedup_fraction_of_ideal']:.0%})")
  lines += _variants(report)
  lines.append(f"peak RSS {report['memory']['peak_rss_bytes'] / 2**30:.2f} GiB")
  if report["platform"] == "cpu" and "hugetlb" not in (env["GLIBC_TUNABLES"] or ""):
    lines.append(f"({t['baseline']['minor_page_faults_per_step']:,.0f} page faults per train "
                 "step: GLIBC_TUNABLES=glibc.malloc.hugetlb=1 backs XLA's buffers with huge "
                 "pages, see docs/performance.md)")
  return "\n".join(lines)


def _proxy(proxy: dict) -> list[str]:
  parts = proxy["parts"]
  return [f"train baseline per token (HLO walk, loops by trip count): "
          f"{proxy['flops'] / 1e6:.4g} MFLOP (matmul {proxy['matmul_flops'] / 1e6:.4g}), "
          f"{proxy['bytes'] / 1e6:.4g} MB accessed; output layer "
          f"{parts['output_layer']['flops'] / 1e6:.4g} MFLOP, "
          f"{parts['output_layer']['bytes'] / 1e6:.4g} MB; attention "
          f"{parts['attention']['flops'] / 1e6:.4g} MFLOP, "
          f"{parts['attention']['bytes'] / 1e6:.4g} MB"]


def _spread(quartiles: list[float]) -> str:
  """The rounds' middle half of a variant's ratio."""
  return f" (rounds' middle half x{quartiles[0]:.3f}-x{quartiles[1]:.3f})"


def _variants(report: dict) -> list[str]:
  base = report["train"]["baseline"]
  lines = []
  for name, v in report["variants"].items():
    train, proxy = v["train"], v["train"]["proxy"]
    evaluation = ("eval not timed" if v["eval"] is None else
                  f"eval (all heads) {v['eval']['tokens_per_s']:,.0f} tokens/s"
                  + (f" = x{v['eval_tokens_per_s_ratio']:.3f}"
                     f"{_spread(v['eval_ratio_quartiles'])}"
                     if v["eval_tokens_per_s_ratio"] else ""))
    lines.append(
        f"variant {name}: train {train['tokens_per_s']:,.0f} tokens/s = "
        f"x{v['train_tokens_per_s_ratio']:.3f}{_spread(v['train_ratio_quartiles'])} of "
        f"the config's, {evaluation}; "
        f"{proxy['flops'] / 1e6:.4g} MFLOP, {proxy['bytes'] / 1e6:.4g} MB per token "
        f"(config {base['proxy']['flops'] / 1e6:.4g}, {base['proxy']['bytes'] / 1e6:.4g}); "
        f"XLA temporaries {(train['xla_temp_bytes'] or 0) / 1e6:,.0f} MB "
        f"(config {(base['xla_temp_bytes'] or 0) / 1e6:,.0f})")
    if "profile" in train:
      lines += [f"  {line}" for line in step_profile.summary(train["profile"])]
  return lines
