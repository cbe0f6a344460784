"""What a training run reports as it goes: metric summaries, progress lines, the gate
history, and the check of its metrics for NaN/inf.

The train loop hands every step's metrics to `TrainProgress.add` (they stay on the
device) and calls `TrainProgress.fetch` at its log, eval and save steps: only then
are the metrics read, so the NaN/inf check adds no host sync of its own.
"""
import json
import sys
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from allatt_jax.config import console
from allatt_jax.pruning import gate_values
from allatt_jax.model import gates as gates_lib
from allatt_jax.model import transformer as model_lib
from allatt_jax.parallel import sharding
from allatt_jax.runs import run_files
from allatt_jax.evaluation import stream_eval
from allatt_jax.config.errors import TrainingError

# Train metrics that only mean something with gates; a baseline run does not log them.
GATE_METRICS = ("l0", "lambda", "open_expected", "open_actual", "groups_open_actual")


class TrainProgress:
  """The metrics of the steps since the last log, and where the logs go.

  Args:
    workdir: the run's folder (its metric logs' and the gate history's).
    cfg: the model, whose gated heads a pruning run reports.
    num_steps, first_step: the run's last step, and the step it starts (or resumes) at.
    tokens_per_step: global batch tokens, for tokens/s.
    metric: 'bpc' or 'ppl'.
    skip_nonfinite: drop the non-finite steps from the summaries (their updates were
      skipped) instead of stopping the run.
    gated: a pruning run: gate metrics, open heads and the gate history are reported.
    freeze_step: a pruning run's gate freeze: before it the gates are sampled, so the
      heads open in a step vary, around an expected count; from it on they are the
      decision.
  """

  def __init__(self, workdir, cfg: model_lib.ModelConfig, *, num_steps: int,
               first_step: int, tokens_per_step: int, metric: str, skip_nonfinite: bool,
               gated: bool, freeze_step: int = 0):
    self.workdir, self.cfg = workdir, cfg
    self.num_steps, self.tokens_per_step, self.metric = num_steps, tokens_per_step, metric
    self.skip_nonfinite, self.gated, self.freeze_step = skip_nonfinite, gated, freeze_step
    self.num_heads = sum(cfg.layer_heads) if gated and cfg.gate.heads else 0
    group = cfg.gate.persistent_group if gated else 0
    self.num_groups = sum(cfg.layer_heads) * cfg.num_persistent // group if group else 0
    self.is_main = jax.process_index() == 0
    metric_writers, periodic_actions = _clu()
    self.writer = metric_writers.create_default_writer(str(workdir),
                                                       just_logging=not self.is_main)
    self._report_progress = periodic_actions.ReportProgress(num_train_steps=num_steps,
                                                            writer=self.writer)
    self.bar = tqdm.tqdm(total=num_steps, initial=first_step,
                         disable=not (self.is_main and sys.stdout.isatty()),
                         dynamic_ncols=True)
    self.first_step = first_step
    self.pending, self.interval_start = [], time.perf_counter()
    self.timed_steps = 0      # the steps since interval_start, none of them compiled

  def add(self, done: int, metrics) -> None:
    """The metrics of step `done` (counted from 1), still on the device."""
    self.pending.append(metrics)
    self._report_progress(done)
    self.bar.update(1)
    # The steps that compile their program (this process's first; a pruning run's
    # first with frozen gates) take a minute where the others take a fraction of a
    # second: the rate, and so the ETA, counts from the end of such a step.
    if done == self.first_step + 1 or (self.gated and done == self.freeze_step + 1):
      self.interval_start, self.timed_steps = time.perf_counter(), 0
    else:
      self.timed_steps += 1

  def fetch(self, done: int) -> list[tuple[int, str, float]]:
    """The pending metrics on the host; (step, metric, value) of each non-finite step.

    Raises:
      NonFiniteStep: a step's loss or gradient norm is NaN or inf, and such steps are
        not skipped.
    """
    self.pending = jax.device_get(self.pending)
    nonfinite = nonfinite_steps(self.pending, done)
    if nonfinite and not self.skip_nonfinite:
      raise NonFiniteStep(*nonfinite[0])
    return nonfinite

  def log(self, done: int, nonfinite, gates) -> None:
    """Writes the summary of the steps since the last log, its console line and (with
    gates) a line of the gate history; `gates`: the state's gate variables."""
    kept = _without_steps(self.pending, done, nonfinite) or self.pending
    summary = summarise(kept, self.metric, self.gated)
    if self.skip_nonfinite:
      summary["nonfinite_steps"] = len(nonfinite)
      if nonfinite:
        logging.warning("Skipped the updates of steps %s: non-finite loss or gradient.",
                        [s for s, _, _ in nonfinite])
    steps_per_s = None      # only compiling steps since the last line: no rate yet
    if self.timed_steps:
      steps_per_s = self.timed_steps / (time.perf_counter() - self.interval_start)
      summary["tokens_per_s"] = steps_per_s * self.tokens_per_step
    self.writer.write_scalars(done, summary)
    self.bar.set_postfix(loss=f"{summary['nll']:.3f}")
    # Every process gathers them: a model axis across processes shards them too.
    host_gates = sharding.on_host(gates) if self.gated else None
    if self.is_main:
      read = gate_values.read(self.cfg, host_gates) if self.gated else None
      kept = read.surviving_heads if read else None
      decided = None if kept is None else sum(len(k) for k in kept)
      slots = read.kept_slots if self.num_groups else None
      groups_decided = None if slots is None else _kept_groups(self.cfg, kept, slots)
      self.bar.write(progress_line(done, self.num_steps, steps_per_s, summary,
                                   self.metric, self.num_heads, decided,
                                   frozen=done > self.freeze_step,
                                   num_groups=self.num_groups,
                                   groups_decided=groups_decided))
      sys.stdout.flush()   # also when stdout is a file: the line is the run's pulse
      if self.gated:
        _append_gate_history(self.workdir, done, host_gates, self.cfg, kept, slots)
    self.pending, self.interval_start, self.timed_steps = [], time.perf_counter(), 0

  def write_eval(self, done: int, results: dict) -> None:
    """A periodic evaluation's results; its time does not count against steps/s."""
    self.writer.write_scalars(done, {f"eval/{k}": v for k, v in results.items()})
    self.interval_start, self.timed_steps = time.perf_counter(), 0

  def write_final(self, step: int, results: dict) -> None:
    """The final evaluation's results, written at once (the run may stop next)."""
    self.writer.write_scalars(step, {f"final/{k}": v for k, v in results.items()})
    self.writer.flush()

  def close(self) -> None:
    self.bar.close()
    self.writer.flush()


def _clu():
  """clu's metric_writers and periodic_actions, imported when a run starts: they
  import TensorFlow, which takes seconds (a command's flag errors and --help should
  not wait for it) and prints C++ start-up notices (oneDNN) to stderr before any log
  level applies."""
  with console.native_stderr_hidden(not console.verbose_requested()):
    from clu import metric_writers  # pylint: disable=g-import-not-at-top
    from clu import periodic_actions  # pylint: disable=g-import-not-at-top
  return metric_writers, periodic_actions


class NonFiniteStep(Exception):
  """A step's loss or gradient norm is NaN or inf (`TrainProgress.fetch`)."""

  def __init__(self, step: int, metric: str, value: float):
    super().__init__(step, metric, value)
    self.step, self.metric, self.value = step, metric, value

  def error(self, last_checkpoint: int | None) -> TrainingError:
    """What the user is told, given the newest checkpoint the run keeps."""
    kept = (f"The last checkpoint, step {last_checkpoint}, predates it and is kept; a "
            "rerun resumes from it" if last_checkpoint is not None
            else "No checkpoint was saved before it")
    return TrainingError(
        f"Non-finite {self.metric} ({self.value}) at step {self.step}: training "
        f"stopped. {kept}, and would diverge the same way. Lower "
        "train.learning_rate, raise train.warmup_steps or set train.grad_clip; or set "
        "train.skip_nonfinite_steps=True to drop such steps' updates and go on.")


def nonfinite_steps(fetched, last_step: int) -> list[tuple[int, str, float]]:
  """(step, metric, value) of each step whose loss or gradient norm is NaN or inf.

  `fetched` holds the host metrics of the steps up to `last_step`, in order.
  """
  found = []
  for step, metrics in enumerate(fetched, last_step - len(fetched) + 1):
    bad = [key for key in ("loss", "grad_norm") if not np.isfinite(metrics[key])]
    if bad:
      found.append((step, bad[0], float(metrics[bad[0]])))
  return found


def _without_steps(fetched, last_step: int, nonfinite) -> list:
  skip = {step for step, _, _ in nonfinite}
  return [m for step, m in enumerate(fetched, last_step - len(fetched) + 1)
          if step not in skip]


# The terms of the loss a progress line shows, as it names them: the cross-entropy in
# nats (what bpc and ppl restate); while distilling, the KL to the teacher and the
# squared error of the layer outputs; while pruning, the value of the L0 term. The
# loss itself, what they add up to with their weights, is in the metrics.
LOSS_TERMS = (("ce", "nll"), ("kl", "distill_kl"), ("mse", "distill_hidden"),
              ("penalty", "penalty"))


def progress_line(step: int, num_steps: int, steps_per_s: float | None, summary: dict,
                  metric: str, num_heads: int, decided: int | None = None,
                  frozen: bool = False, num_groups: int = 0,
                  groups_decided: int | None = None) -> str:
  """'step  100/2500  bpc 2.9045  ce 2.0133  12.3 steps/s  ETA 3m15s': the terms of
  the loss the run has (LOSS_TERMS); the rate of the steps since the last line that
  compiled nothing, and the ETA the time left at that rate (neither when no such step
  ran); plus, for a pruning run (`num_heads` > 0), its heads and λ: while the gates
  are sampled, the mean count open in the steps since the last line (an expectation)
  and the heads the gates keep now (`decided`: the deterministic rule, what a freeze
  or an export would keep); once `frozen`, the heads kept. With gated persistent
  groups (`num_groups` > 0), the same of the groups (of the heads kept)."""
  line = f"step {step:{len(str(num_steps))}d}/{num_steps}  {metric} {summary[metric]:.4f}"
  for name, key in LOSS_TERMS:
    if key in summary:
      line += f"  {name} {summary[key]:.4f}"
  if steps_per_s is not None:
    line += (f"  {steps_per_s:.1f} steps/s  "
             f"ETA {console.duration((num_steps - step) / steps_per_s)}")
  kinds = [("heads", num_heads, decided, "open_actual/total")] if num_heads else []
  if num_groups:
    kinds.append(("groups", num_groups, groups_decided, "groups_open_actual/total"))
  for kind, total, kept, key in kinds:
    if frozen:
      line += f"  {kind} kept {kept}/{total} (frozen)"
    else:
      line += f"  {kind} open {summary[key]:.1f}/{total} expected, {kept} decided"
  if kinds:
    line += f"  λ {summary['lambda']:.4g}"
  return line


def _kept_groups(cfg: model_lib.ModelConfig, kept_heads, slots) -> int:
  """The persistent groups the deterministic rule keeps, of the heads it keeps."""
  return sum(len(slots[i][h]) for i, heads in enumerate(kept_heads) for h in heads
             ) // cfg.gate.persistent_group


def summarise(fetched, metric: str, gated: bool) -> dict[str, float]:
  """Means over the logging interval; per-layer vectors become one scalar per layer.
  A metric that only some of its steps have (the L0 term, up to the gate freeze) is
  the mean of those steps."""
  summary = {}
  for key in dict.fromkeys(key for m in fetched for key in m):
    if not gated and key in GATE_METRICS:
      continue
    mean = np.mean([m[key] for m in fetched if key in m], axis=0)
    if np.ndim(mean):
      summary.update({f"{key}/layer_{i}": float(v) for i, v in enumerate(mean)})
      summary[f"{key}/total"] = float(np.sum(mean))
    else:
      summary[key] = float(mean)
  summary[metric] = stream_eval.metric_value(summary["nll"], metric)
  return summary


def _append_gate_history(workdir, step, host_gates, cfg: model_lib.ModelConfig,
                         kept, slots=None) -> None:
  """Per-layer, per-head probabilities that the gate is open in the forward pass (the
  deterministic rule keeps a hard gate iff it is >= 1/2), and the heads that rule
  keeps now (`kept`: `gate_values.Gates.surviving_heads`), for the gates heat map;
  with gated persistent groups, the same per head and group (`slots`:
  `gate_values.Gates.kept_slots`)."""
  open_probability = lambda logits: np.asarray(gates_lib.forward_open_probability(
      jnp.asarray(logits), cfg.gate)).tolist()
  layers = [host_gates.get(f"layer_{i}", {}).get("attention", {})
            for i in range(cfg.num_layers)]
  probs = [open_probability(g["logits"]) if "logits" in g else [] for g in layers]
  decided = [[int(h in kept_H) for h in range(len(layer))]
             for layer, kept_H in zip(probs, kept)]
  record = {"step": step, "open_prob": probs, "decided": decided}
  if slots is not None:
    group = cfg.gate.persistent_group
    record["persistent_open_prob"] = [
        open_probability(g[gate_values.GROUP_LOGITS]) if g else [] for g in layers]
    record["persistent_decided"] = [
        [] if layer is None else
        [np.isin(np.arange(0, cfg.num_persistent, group), s).astype(int).tolist()
         for s in layer] for layer in slots]
  with (run_files.run_path(workdir) / run_files.GATE_HISTORY_FILE).open("a") as f:
    f.write(json.dumps(record) + "\n")
