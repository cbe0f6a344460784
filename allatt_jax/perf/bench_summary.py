"""The benchmark's report (timing.measure) as a few human-readable lines."""
from allatt_jax.perf import step_profile


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
    lines.append(f"gated step overhead {t['gated_overhead']:+.1%}")
    lines.append(f"distilling step against the gated one: {t['distill_overhead']:+.1%} "
                 f"time, XLA temporaries x{t.get('distill_temp_ratio', float('nan')):.2f}")
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


def _variants(report: dict) -> list[str]:
  base = report["train"]["baseline"]
  lines = []
  for name, v in report["variants"].items():
    train, proxy = v["train"], v["train"]["proxy"]
    evaluation = (f"eval (all heads) {v['eval']['tokens_per_s']:,.0f} tokens/s"
                  + (f" = x{v['eval_tokens_per_s_ratio']:.3f}"
                     if v["eval_tokens_per_s_ratio"] else ""))
    lines.append(
        f"variant {name}: train {train['tokens_per_s']:,.0f} tokens/s = "
        f"x{v['train_tokens_per_s_ratio']:.3f} of the config's, {evaluation}; "
        f"{proxy['flops'] / 1e6:.4g} MFLOP, {proxy['bytes'] / 1e6:.4g} MB per token "
        f"(config {base['proxy']['flops'] / 1e6:.4g}, {base['proxy']['bytes'] / 1e6:.4g}); "
        f"XLA temporaries {(train['xla_temp_bytes'] or 0) / 1e6:,.0f} MB "
        f"(config {(base['xla_temp_bytes'] or 0) / 1e6:,.0f})")
    if "profile" in train:
      lines += [f"  {line}" for line in step_profile.summary(train["profile"])]
  return lines
