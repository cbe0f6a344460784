"""Training and pruning runs: setup, state, the train loop, final evaluation.

A run is a baseline run (no gates) or a pruning run (`gates.enabled`, usually with
`init_from` a baseline workdir). Restarting on the same workdir resumes from the
latest checkpoint, data position and memory included.
"""
import functools
import json
import sys
import time

from absl import logging
from clu import metric_writers
from clu import periodic_actions
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm

from allatt_jax import checkpointing
from allatt_jax import data as data_lib
from allatt_jax import evaluate
from allatt_jax import export
from allatt_jax import gates as gates_lib
from allatt_jax import model as model_lib
from allatt_jax import optim
from allatt_jax import sharding
from allatt_jax import steps
from allatt_jax import validation
from allatt_jax.errors import ConfigError
from allatt_jax.errors import Preempted
from allatt_jax.errors import TrainingError

GATE_HISTORY_FILE = "gate_history.jsonl"


def abstract_state(lm: model_lib.TransformerLM, optimizer, config: ml_collections.ConfigDict,
                   mesh):
  """Shapes, dtypes and shardings of the train state, without allocating it.

  Returns (state of jax.ShapeDtypeStructs carrying their shardings, state shardings).
  """
  init = functools.partial(steps.init_state, lm, optimizer, config, boxed=True)
  with sharding.activate(mesh):
    boxed = jax.eval_shape(init, jax.random.key(0))
  shardings = sharding.logical_shardings(mesh, boxed)
  shardings = shardings.replace(memory=sharding.memory_sharding(mesh))
  return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      nn.unbox(boxed), shardings), shardings


class Run:
  """Everything a run needs besides its state: corpus, mesh, model, optimizer."""

  def __init__(self, config: ml_collections.ConfigDict):
    self.config = config
    self.corpus = data_lib.load_run_corpus(config)
    if self.corpus.vocab_size != config.model.vocab_size:
      raise ConfigError(
          f"config.model.vocab_size is {config.model.vocab_size} but dataset "
          f"{config.data.name!r} has {self.corpus.vocab_size} types; set "
          f"--config.model.vocab_size={self.corpus.vocab_size}.")
    self.mesh = sharding.make_mesh(config.mesh)
    self.lm = model_lib.TransformerLM(model_lib.model_config(config))
    self.optimizer = optim.make_optimizer(config)

  def abstract_state(self):
    return abstract_state(self.lm, self.optimizer, self.config, self.mesh)

  def new_state(self, state_sharding):
    init = functools.partial(steps.init_state, self.lm, self.optimizer, self.config)
    with sharding.activate(self.mesh):
      state = jax.jit(init, out_shardings=state_sharding)(
          jax.random.key(self.config.train.seed))
    if self.config.init_from:
      state = self._start_from_baseline(state, state_sharding)
    return state

  def _start_from_baseline(self, state, state_sharding):
    """Baseline params into a fresh state; gates stay at their init, optimizer fresh.

    `validation.check_run` has checked that the baseline's shapes fit the config.
    """
    baseline = checkpointing.restore_variables(self.config.init_from)["params"]
    variables = {**state.variables, "params": baseline}
    with sharding.activate(self.mesh):
      fresh = jax.jit(lambda v: state.replace(variables=v, opt_state=self.optimizer.init(v)),
                      out_shardings=state_sharding)
      return fresh(variables)

  def evaluator(self) -> evaluate.Evaluator:
    e = self.config.eval
    return evaluate.Evaluator(self.lm, self.mesh, batch_size=e.batch_size,
                              seq_len=e.seq_len, mem_len=e.mem_len)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       deadline: float | None = None) -> dict:
  """Trains (or resumes) the run in `workdir`; returns the final metrics.

  Past `deadline` (a time.monotonic() value) training stops as on SIGTERM: a checkpoint
  of the current step, then Preempted. One process only: hosts would stop at
  different steps.
  """
  if deadline is not None and jax.process_count() > 1:
    raise ConfigError("A training deadline needs a single process.")
  # --- Setup.
  workdir = checkpointing.run_path(workdir)
  validation.check_run(config, workdir)
  run = Run(config)
  vocabulary = checkpointing.vocabulary_fingerprint(run.corpus.name, run.corpus.vocab)
  validation.check_vocabulary(vocabulary, workdir, config.init_from)
  is_main = jax.process_index() == 0
  if is_main:
    checkpointing.save_config(workdir, config)
    checkpointing.save_vocabulary(workdir, vocabulary)
  writer = metric_writers.create_default_writer(str(workdir), just_logging=not is_main)
  train_cfg = config.train
  tokens_per_step = train_cfg.batch_size * train_cfg.seq_len

  # --- State: resume, or start fresh (from a baseline for pruning runs).
  abstract_state, state_sharding = run.abstract_state()
  checkpoints = checkpointing.RunCheckpoints(workdir, keep=config.checkpoint.keep)
  stream = data_lib.SegmentStream(run.corpus.splits["train"], train_cfg.batch_size,
                                  train_cfg.seq_len, *sharding.process_rows(run.mesh))
  if (latest := checkpoints.latest_step()) is not None:
    logging.info("Resuming from step %d in %s", latest, checkpoints.directory)
    state, data_state = checkpoints.restore(latest, abstract_state)
    stream.set_state(data_state)
  else:
    state = run.new_state(state_sharding)
  gated = "gates" in state.variables

  batch = sharding.batch_sharding(run.mesh)
  step_fns = {
      sample: steps.jit_train_step(run.lm, run.optimizer, config, state_sharding, batch,
                                   sharding.replicated(run.mesh), sample_gates=sample)
      for sample in ((True, False) if gated else (False,))}
  evaluator = run.evaluator()
  report_progress = periodic_actions.ReportProgress(
      num_train_steps=train_cfg.num_steps, writer=writer)
  progress = tqdm.tqdm(total=train_cfg.num_steps, initial=int(state.step),
                       disable=not (is_main and sys.stdout.isatty()), dynamic_ncols=True)

  # --- Train loop. Metrics stay on device until a log, evaluation or save reads them,
  # so checking them for NaN/inf adds no host sync of its own.
  shape = (train_cfg.batch_size, train_cfg.seq_len)
  pending, interval_start = [], time.perf_counter()
  try:
    with checkpointing.PreemptionWatch(checkpoints) as preemption:
      for step in range(int(state.step), train_cfg.num_steps):
        inputs, targets = (data_lib.to_global_array(a, batch, shape) for a in next(stream))
        sample = gated and step < config.gates.freeze_step
        with sharding.activate(run.mesh):
          state, metrics = step_fns[sample](state, inputs, targets)
        pending.append(metrics)
        done = step + 1
        report_progress(done)
        progress.update(1)

        log = done % train_cfg.log_every_steps == 0 or done == train_cfg.num_steps
        evaluate_now = bool(config.eval.every_steps) and done % config.eval.every_steps == 0
        save = done % config.checkpoint.every_steps == 0 or done == train_cfg.num_steps
        out_of_time = deadline is not None and time.monotonic() >= deadline
        preempted = preemption.reached(done) or out_of_time
        if log or evaluate_now or save or preempted:
          pending = jax.device_get(pending)
          nonfinite = _nonfinite_steps(pending, done)
          if nonfinite and not train_cfg.skip_nonfinite_steps:
            raise _nonfinite_error(*nonfinite[0], checkpoints)

        if log:
          summary = _summarise(_without_steps(pending, done, nonfinite) or pending,
                               run.corpus.metric)
          if train_cfg.skip_nonfinite_steps:
            summary["nonfinite_steps"] = len(nonfinite)
            if nonfinite:
              logging.warning("Skipped the updates of steps %s: non-finite loss or "
                              "gradient.", [s for s, _, _ in nonfinite])
          elapsed = time.perf_counter() - interval_start
          summary["tokens_per_s"] = len(pending) * tokens_per_step / elapsed
          writer.write_scalars(done, summary)
          progress.set_postfix(loss=f"{summary['nll']:.3f}")
          if gated and is_main:
            _append_gate_history(workdir, done, state.variables["gates"], run.lm.cfg)
          pending, interval_start = [], time.perf_counter()

        if evaluate_now:
          results = evaluate.evaluate_splits(evaluator, state.variables, run.corpus,
                                             ("valid",), config.eval.max_batches)
          writer.write_scalars(done, {f"eval/{k}": v for k, v in results.items()})
          interval_start = time.perf_counter()

        if save or preempted:
          checkpoints.save(done, state, stream.get_state(), force=True)
        if preempted:
          checkpoints.wait()
          reason = "Time box reached" if out_of_time else "Preempted"
          raise Preempted(
              f"{reason}: saved a checkpoint at step {done} of {train_cfg.num_steps} in "
              f"{checkpoints.directory}. Rerun the same command to resume.")
  finally:
    progress.close()
    writer.flush()
    # Whatever stopped the loop, the save in flight completes (or never counts).
    checkpoints.wait()
    checkpoints.close()

  # --- Final evaluation.
  results = evaluate.evaluate_splits(evaluator, state.variables, run.corpus)
  writer.write_scalars(train_cfg.num_steps, {f"final/{k}": v for k, v in results.items()})
  writer.flush()
  results["metric"] = run.corpus.metric
  if gated:
    results["export"] = _export_and_evaluate(workdir, run)
  if is_main:
    (workdir / "results.json").write_text(json.dumps(results, indent=2))
  return results


def _export_and_evaluate(workdir, run: Run) -> dict:
  """Removes the closed heads and scores the smaller model on valid and test."""
  export_dir = export.export_run(workdir)
  exported_config, variables = checkpointing.load_model(export_dir)
  lm = model_lib.TransformerLM(model_lib.model_config(exported_config))
  e = run.config.eval
  evaluator = evaluate.Evaluator(lm, run.mesh, batch_size=e.batch_size, seq_len=e.seq_len,
                                 mem_len=e.mem_len)
  results = evaluate.evaluate_splits(evaluator, variables, run.corpus)
  results["heads_per_layer"] = list(lm.cfg.layer_heads)
  results["directory"] = str(export_dir)
  return results


def _layer_gates(gates, num_layers):
  """Each layer's gate variables (None for a layer without heads)."""
  return [gates.get(f"layer_{i}") for i in range(num_layers)]


def _nonfinite_steps(fetched, last_step: int) -> list[tuple[int, str, float]]:
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


def _nonfinite_error(step: int, metric: str, value: float,
                     checkpoints: checkpointing.RunCheckpoints) -> TrainingError:
  checkpoints.wait()
  last = checkpoints.latest_step()
  kept = (f"The last checkpoint, step {last}, predates it and is kept; a rerun resumes "
          "from it" if last is not None else "No checkpoint was saved before it")
  return TrainingError(
      f"Non-finite {metric} ({value}) at step {step}: training stopped. {kept}, and "
      "would diverge the same way. Lower train.learning_rate, raise "
      "train.warmup_steps or set train.grad_clip; or set "
      "train.skip_nonfinite_steps=True to drop such steps' updates and go on.")


def _summarise(pending, metric: str) -> dict[str, float]:
  """Means over the logging interval; per-layer vectors become one scalar per layer."""
  fetched = jax.device_get(pending)
  summary = {}
  for key in fetched[0]:
    mean = np.mean([m[key] for m in fetched], axis=0)
    if np.ndim(mean):
      summary.update({f"{key}/layer_{i}": float(v) for i, v in enumerate(mean)})
      summary[f"{key}/total"] = float(np.sum(mean))
    else:
      summary[key] = float(mean)
  summary[metric] = evaluate.metric_value(summary["nll"], metric)
  return summary


def _append_gate_history(workdir, step, gates, cfg: model_lib.ModelConfig) -> None:
  """Per-layer, per-head open probabilities, for the gates heat map."""
  probs = [np.asarray(gates_lib.open_probability(jnp.asarray(g["attention"]["logits"]),
                                                 cfg.gate)).tolist() if g else []
           for g in _layer_gates(jax.device_get(gates), cfg.num_layers)]
  with (checkpointing.run_path(workdir) / GATE_HISTORY_FILE).open("a") as f:
    f.write(json.dumps({"step": step, "open_prob": probs}) + "\n")
