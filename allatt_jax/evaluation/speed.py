"""Inference speeds of trained models, timed in interleaved rounds on the same tokens.

Each round times every model once, in turn (baseline, pruned, baseline, pruned, ...),
so a change of the machine's load in the middle of the measurement slows both alike;
a model's speed is the median over the rounds, and a speed-up the median of the
rounds' ratios, with the middle half of them as its spread. Each timed run also
counts this process's CPU time: CPU time per token hardly moves with other processes'
load, where tokens per second does. The machine's load during the rounds is measured
too (`_load`), so a figure timed on a busy machine says so.
"""
from collections.abc import Callable, Mapping
import os
import time

import jax
import numpy as np

from allatt_jax.config.run_config import RunConfig
from allatt_jax.evaluation import stream_eval
from allatt_jax.runs.trained_model import LoadedModel

# With the demo's 10 batches a timed run, on a 2-core machine that one other busy
# process shared, four comparisons of 30 rounds agreed within ±4.1% (of 9 rounds of
# 100 batches, within ±6.9%): docs/performance.md, "How the demo times its speed-up".
ROUNDS = 30
# The machine counts as busy when the timings left less than this many of its cores
# idle while other processes used them: the timed runs then waited for a core.
IDLE_CORES_WHEN_BUSY = 0.5


def tokens_per_s(config: RunConfig, mesh: jax.sharding.Mesh, tokens, num_batches: int,
                 models: Mapping[str, LoadedModel], rounds: int = ROUNDS,
                 safe_point: Callable[[], None] = lambda: None) -> dict:
  """The inference speeds of `models`, each evaluating with memory `num_batches`
  batches of `tokens` (at `config`'s eval batch and lengths, on `mesh`) once per
  round, in turn, after an untimed compile each:
  - '{name}_tokens_per_s': the median over the rounds, and each round's in
    '{name}_tokens_per_s_rounds';
  - '{name}_cpu_us_per_token': the median of this process's CPU time per token (all
    its threads), each round's in '{name}_cpu_us_per_token_rounds';
  - 'rounds', and 'machine': its load during the rounds (`_load`).

  `safe_point` is called before each compile and each timed run, the last included:
  it may stop the command there (by raising), as a signal asks.
  """
  evaluators = {}
  for name, model in models.items():
    safe_point()
    evaluator = stream_eval.Evaluator.from_config(model.lm, mesh, config)
    evaluator.score(model.variables, tokens, max_batches=1)   # compile, untimed
    evaluators[name] = evaluator, model.variables
  timed = {name: {"tokens_per_s": [], "cpu_us_per_token": []} for name in evaluators}
  start = _cpu_seconds()
  for _ in range(rounds):
    for name, (evaluator, variables) in evaluators.items():
      safe_point()
      wall_s, cpu_s = time.perf_counter(), time.process_time()
      scored = evaluator.score(variables, tokens, max_batches=num_batches)
      wall_s, cpu_s = time.perf_counter() - wall_s, time.process_time() - cpu_s
      timed[name]["tokens_per_s"].append(scored["tokens"] / wall_s)
      timed[name]["cpu_us_per_token"].append(1e6 * cpu_s / scored["tokens"])
  speeds = {"rounds": rounds, "machine": _load(start, _cpu_seconds())}
  for name, figures in timed.items():
    for figure, values in figures.items():
      speeds[f"{name}_{figure}"] = float(np.median(values))
      speeds[f"{name}_{figure}_rounds"] = values
  return speeds


def speedup(speeds: dict, model: str = "pruned", reference: str = "baseline") -> dict:
  """`model`'s speed-up over `reference` in `speeds` (`tokens_per_s`'s): 'speedup',
  the median of the rounds' ratios of tokens per second, with 'speedup_quartiles',
  the middle half of them; 'cpu_speedup', the median of the rounds' ratios of CPU
  time per token."""
  wall = np.divide(speeds[f"{model}_tokens_per_s_rounds"],
                   speeds[f"{reference}_tokens_per_s_rounds"])
  cpu = np.divide(speeds[f"{reference}_cpu_us_per_token_rounds"],
                  speeds[f"{model}_cpu_us_per_token_rounds"])
  return {"speedup": float(np.median(wall)),
          "speedup_quartiles": [float(q) for q in np.percentile(wall, (25, 75))],
          "cpu_speedup": float(np.median(cpu))}


def _cpu_seconds() -> tuple[float, float, float | None]:
  """(wall clock, this process's CPU seconds, the CPU seconds every process on the
  machine has run since it started: Linux's /proc/stat, else None)."""
  wall, own = time.monotonic(), time.process_time()
  try:
    with open("/proc/stat", encoding="ascii") as stat:
      # user nice system idle iowait irq softirq steal ...: all but idle and iowait.
      ticks = [int(t) for t in stat.readline().split()[1:9]]
  except (OSError, ValueError):
    return wall, own, None
  return wall, own, (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _load(start, end) -> dict:
  """The machine's load between two `_cpu_seconds()`: 'cores', and the cores this
  process ('own_cores') and the others ('other_cores') used on average; 'busy'
  when the others used some and less than IDLE_CORES_WHEN_BUSY stayed idle. Without
  /proc/stat, the 1-minute load average stands for the cores all used."""
  cores = os.cpu_count() or 1
  wall = max(end[0] - start[0], 1e-9)
  own = (end[1] - start[1]) / wall
  used = ((end[2] - start[2]) / wall if start[2] is not None and end[2] is not None
          else os.getloadavg()[0])
  other = max(used - own, 0.0)
  return {"cores": cores, "own_cores": round(own, 2), "other_cores": round(other, 2),
          "busy": other > 0.05 * cores and used > cores - IDLE_CORES_WHEN_BUSY}
