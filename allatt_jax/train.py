"""Training and pruning runs: setup, state, the train loop, final evaluation.

A run is a baseline run (no gates) or a pruning run (`gates.enabled`, usually with
`init_from` a baseline workdir). Restarting on the same workdir resumes from the
latest checkpoint, data position and memory included. The phases after training (the
final evaluation; a pruning run's export) each record their result in
PHASES_FILE when done, so a rerun after a preemption does not redo them.
"""
import json
import sys
import time

from absl import logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import tqdm

from allatt_jax import budget
from allatt_jax import checkpointing
from allatt_jax import config_checks
from allatt_jax import console
from allatt_jax import cost_model
from allatt_jax import data as data_lib
from allatt_jax import evaluation
from allatt_jax import exported_model
from allatt_jax import gates as gates_lib
from allatt_jax import model as model_lib
from allatt_jax import preemption
from allatt_jax import prune
from allatt_jax import run_setup
from allatt_jax import rundir
from allatt_jax import sharding
from allatt_jax import validation
from allatt_jax.errors import ConfigError
from allatt_jax.errors import Preempted
from allatt_jax.errors import TrainingError
from allatt_jax.run_config import RunConfig

# Train metrics that only mean something with gates; a baseline run does not log them.
GATE_METRICS = ("l0", "lambda", "open_expected", "open_actual")
PHASES_FILE = "finished_phases.json"
BUDGET_FILE = "budget_decision.json"    # budget runs: the heads decided at the freeze


def start(config: RunConfig, workdir
          ) -> tuple[run_setup.RunSetup, checkpointing.RunCheckpoints]:
  """The run's setup and its one CheckpointManager, after every check that needs
  neither the dataset nor a compiled step (config, workdir, resume, `init_from`).

  Raises:
    ConfigError: an inconsistent or out-of-range config, an unwritable workdir, or a
      pruning run without `init_from`.
    CheckpointError: `init_from` is missing, unreadable or does not fit the config, or
      `workdir` holds a checkpoint of a run with other shapes than this config gives.
  """
  workdir = rundir.run_path(workdir)
  setup = run_setup.resolve(config)
  config_checks.check_starting_point(setup.run)
  # Before the workdir is made: a wrong init_from leaves nothing behind.
  validation.check_init_from(setup.run, setup.abstract_state)
  validation.check_workdir(workdir)
  checkpoints = checkpointing.RunCheckpoints(workdir, keep=setup.run.checkpoint.keep)
  try:
    validation.check_resume(setup.run, checkpoints, setup.abstract_state)
  except BaseException:
    checkpoints.close()
    raise
  return setup, checkpoints


def _clu():
  """clu's metric_writers and periodic_actions, imported when a run starts: they
  import TensorFlow, which takes seconds (a command's flag errors and --help should
  not wait for it) and prints C++ start-up notices (oneDNN) to stderr before any log
  level applies."""
  with console.native_stderr_hidden(not console.verbose_requested()):
    from clu import metric_writers  # pylint: disable=g-import-not-at-top
    from clu import periodic_actions  # pylint: disable=g-import-not-at-top
  return metric_writers, periodic_actions


def _new_state(setup: run_setup.RunSetup):
  """A fresh state; a pruning run's takes the params of `init_from` (a run or an
  exported model), its gates at their init and its optimizer fresh. A distilling
  run's teacher is a copy of those params.

  `validation.check_init_from` has checked that those params' shapes fit the config.
  """
  state = setup.new_state()
  source_dir = setup.run.init_source
  if not source_dir:
    return state
  _, source = checkpointing.load_model(source_dir)
  variables = {**state.variables, "params": source["params"]}

  def from_source(variables):
    teacher = None
    if state.teacher is not None:   # a copy: the student's params will change
      teacher = {**state.teacher, "params": jax.tree.map(jnp.copy, variables["params"])}
    return state.replace(variables=variables, opt_state=setup.optimizer.init(variables),
                         teacher=teacher)

  with sharding.activate(setup.mesh):
    return jax.jit(from_source, out_shardings=setup.state_sharding)(variables)


def train_and_evaluate(config: RunConfig, workdir: str,
                       deadline: float | None = None,
                       watch: preemption.PreemptionWatch | None = None,
                       gate_flags: str = "--config.gates") -> dict:
  """Trains (or resumes) the run in `workdir`; returns the final metrics.

  `gate_flags`: how the caller's command line names the gates section, for advice
  (a pipeline's pruning stage is set under --config.pipeline.prune_gates).

  On SIGTERM (`watch`: the calling command's, else the run's own) the run stops at
  the next safe point with Preempted: after the current step, with its checkpoint, or
  after the phase in progress. Past `deadline` (a time.monotonic() value) training
  stops as on SIGTERM. One process only: hosts would stop at different steps.
  """
  if deadline is not None and jax.process_count() > 1:
    raise ConfigError("A training deadline needs a single process.")
  workdir = rundir.run_path(workdir)
  with preemption.watching(watch) as watch:
    # The config, then its dataset, are checked before `start` creates the workdir and
    # opens orbax, so a wrong data folder leaves nothing behind.
    config = RunConfig.of(config)
    config_checks.check_starting_point(config)
    config, corpus = run_setup.prepare(config)
    setup, checkpoints = start(config, workdir)
    try:
      return _train_and_evaluate(setup, workdir, checkpoints, corpus, deadline, watch,
                                 gate_flags)
    finally:
      # Whatever stopped the run, the save in flight completes (or never counts).
      checkpoints.wait()
      checkpoints.close()


def _train_and_evaluate(setup: run_setup.RunSetup, workdir,
                        checkpoints: checkpointing.RunCheckpoints,
                        corpus: data_lib.Corpus, deadline: float | None,
                        watch: preemption.PreemptionWatch, gate_flags: str) -> dict:
  config = setup.run
  latest = checkpoints.latest_step()
  vocabulary = rundir.vocabulary_fingerprint(corpus.name, corpus.vocab)
  validation.check_vocabulary(vocabulary, workdir, config.init_source,
                              resuming=latest is not None)
  is_main = jax.process_index() == 0
  if is_main:
    rundir.save_config(workdir, config)
    rundir.save_vocabulary(workdir, vocabulary)
    rundir.save_tokenizer(workdir, corpus.tokenizer.to_dict())
  metric_writers, periodic_actions = _clu()
  writer = metric_writers.create_default_writer(str(workdir), just_logging=not is_main)
  train_cfg = config.train
  tokens_per_step = train_cfg.batch_size * train_cfg.seq_len

  # --- State: resume, or start fresh (from a baseline for pruning runs).
  stream = data_lib.SegmentStream(corpus.splits["train"], train_cfg.batch_size,
                                  train_cfg.seq_len, *sharding.process_rows(setup.mesh))
  if latest is not None:
    resumed, state, data_state = checkpoints.restore_newest(setup.abstract_state)
    logging.info("Resuming from step %d in %s", resumed, checkpoints.directory)
    stream.set_state(data_state)
  else:
    state = _new_state(setup)
  gated = "gates" in state.variables
  num_heads = sum(setup.lm.cfg.layer_heads) if gated else 0
  # Phase results count only for the state they were computed from.
  phases = (_finished_phases(workdir, config) if int(state.step) == train_cfg.num_steps
            else {"key": _phases_key(config)})

  batch = sharding.batch_sharding(setup.mesh)
  step_fns = {sample: setup.train_step(sample_gates=sample)
              for sample in ((True, False) if gated else (False,))}
  evaluator = setup.evaluator
  report_progress = periodic_actions.ReportProgress(
      num_train_steps=train_cfg.num_steps, writer=writer)
  progress = tqdm.tqdm(total=train_cfg.num_steps, initial=int(state.step),
                       disable=not (is_main and sys.stdout.isatty()), dynamic_ncols=True)

  # --- Train loop. Metrics stay on device until a log, evaluation or save reads them,
  # so checking them for NaN/inf adds no host sync of its own.
  shape = (train_cfg.batch_size, train_cfg.seq_len)
  pending, interval_start = [], time.perf_counter()
  budgeted = setup.penalty.allowed is not None
  freeze_step = config.gates.freeze_step
  try:
    for step in range(int(state.step), train_cfg.num_steps):
      if budgeted and step == freeze_step:
        state = _keep_budgeted_heads(setup, workdir, state, step)
      inputs, targets = (data_lib.to_global_array(a, batch, shape) for a in next(stream))
      sample = gated and step < config.gates.freeze_step
      with sharding.activate(setup.mesh):
        state, metrics = step_fns[sample](state, inputs, targets)
      pending.append(metrics)
      done = step + 1
      report_progress(done)
      progress.update(1)

      log = done % train_cfg.log_every_steps == 0 or done == train_cfg.num_steps
      evaluate_now = bool(config.eval.every_steps) and done % config.eval.every_steps == 0
      save = done % config.checkpoint.every_steps == 0 or done == train_cfg.num_steps
      out_of_time = deadline is not None and time.monotonic() >= deadline
      preempted = watch.reached() or out_of_time
      if log or evaluate_now or save or preempted:
        pending = jax.device_get(pending)
        nonfinite = _nonfinite_steps(pending, done)
        if nonfinite and not train_cfg.skip_nonfinite_steps:
          raise _nonfinite_error(*nonfinite[0], checkpoints)

      if log:
        summary = _summarise(_without_steps(pending, done, nonfinite) or pending,
                             corpus.metric, gated)
        if train_cfg.skip_nonfinite_steps:
          summary["nonfinite_steps"] = len(nonfinite)
          if nonfinite:
            logging.warning("Skipped the updates of steps %s: non-finite loss or "
                            "gradient.", [s for s, _, _ in nonfinite])
        steps_per_s = len(pending) / (time.perf_counter() - interval_start)
        summary["tokens_per_s"] = steps_per_s * tokens_per_step
        writer.write_scalars(done, summary)
        progress.set_postfix(loss=f"{summary['nll']:.3f}")
        if is_main:
          progress.write(_progress_line(done, train_cfg.num_steps, steps_per_s, summary,
                                        corpus.metric, num_heads))
          sys.stdout.flush()   # also when stdout is a file: the line is the run's pulse
        if gated and is_main:
          _append_gate_history(workdir, done, state.variables["gates"], setup.lm.cfg)
        pending, interval_start = [], time.perf_counter()

      if evaluate_now:
        results = evaluation.evaluate_splits(evaluator, state.variables, corpus,
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

  if budgeted and freeze_step == train_cfg.num_steps:
    # Gates that freeze with the last step: the decision is made on the final state
    # (idempotent, so a rerun of a finished run changes nothing).
    state = _keep_budgeted_heads(setup, workdir, state, freeze_step)

  # --- Phases after training, each skipped if a run before this one finished it.
  watch.stop_if_asked(f"training (checkpoint of step {train_cfg.num_steps} in "
                      f"{checkpoints.directory})", "run the final evaluation")
  if "final" not in phases:
    phases["final"] = evaluation.evaluate_splits(evaluator, state.variables, corpus)
    writer.write_scalars(train_cfg.num_steps,
                         {f"final/{k}": v for k, v in phases["final"].items()})
    writer.flush()
    _save_phases(workdir, phases)
  if is_main:
    print(_results_line("final" + (" (gated)" if gated else ""), phases["final"],
                        corpus.metric), flush=True)
  next_phase = "export the pruned model" if gated else "write results.json"
  watch.stop_if_asked(f"the final evaluation (kept in {workdir / PHASES_FILE})",
                      next_phase)
  if gated:
    if "export" not in phases:
      phases["export"] = _export_and_evaluate(workdir, setup, corpus, state.variables,
                                              gate_flags)
      _save_phases(workdir, phases)
    watch.stop_if_asked(f"the export to {phases['export']['directory']}",
                        "write results.json")
  results = {**phases["final"], "metric": corpus.metric}
  if gated:
    results["export"] = phases["export"]
  if is_main:
    rundir.write_json(workdir / "results.json", results)
  return results


def _keep_budgeted_heads(setup: run_setup.RunSetup, workdir, state, step: int):
  """The state with exactly the budget's n* heads open (`prune.keep_open_heads`),
  the decision recorded in BUDGET_FILE and on the console.

  Made when the gates freeze, so the last steps train the model at its final size.
  """
  gates = state.variables["gates"]
  if jax.process_count() > 1:
    host_gates = multihost_utils.process_allgather(gates, tiled=True)
  else:
    host_gates = jax.device_get(gates)
  new_gates, decision = prune.keep_open_heads(setup.lm.cfg, host_gates,
                                              setup.penalty.allowed)
  path = workdir / BUDGET_FILE
  if decision["changed"] or not path.is_file():
    if jax.process_index() == 0:
      rundir.write_json(path, {"step": step, **decision})
      print(_budget_line(decision, sum(setup.lm.cfg.layer_heads)), flush=True)
  if not decision["changed"]:
    return state
  new_gates = jax.device_put(new_gates, setup.state_sharding.variables["gates"])
  return state.replace(variables={**state.variables, "gates": new_gates})


def _budget_line(decision: dict, num_heads: int) -> str:
  line = (f"budget: the gates keep {decision['by_gates']} of {num_heads} heads at the "
          f"freeze, the budget allows {decision['allowed']}")
  if not decision["changed"]:
    return line + ": kept as they are"
  return line + (f": {decision['changed']} head decision(s) changed by logit rank "
                 f"(opened {len(decision['opened'])}, closed {len(decision['closed'])})")


def budget_decision(workdir) -> dict | None:
  """What the budget decided at the freeze (`_keep_budgeted_heads`), or None."""
  path = rundir.run_path(workdir) / BUDGET_FILE
  return json.loads(path.read_text()) if path.is_file() else None


def _phases_key(config: RunConfig) -> dict:
  """What the phases' results depend on besides the final state."""
  return {"step": config.train.num_steps, "eval": config.eval.to_dict()}


def _finished_phases(workdir, config: RunConfig) -> dict:
  """The results of the phases after training that a run before this one finished:
  {'final': ..., 'export': ...}, each present if done for this num_steps and eval."""
  path, key = workdir / PHASES_FILE, _phases_key(config)
  saved = json.loads(path.read_text()) if path.is_file() else {}
  return saved if saved.get("key") == key else {"key": key}


def _save_phases(workdir, phases: dict) -> None:
  if jax.process_index() == 0:
    rundir.write_json(workdir / PHASES_FILE, phases)


def _export_and_evaluate(workdir, setup: run_setup.RunSetup, corpus: data_lib.Corpus,
                         variables, gate_flags: str) -> dict:
  """The final state's export and its scores (`exported_model.export_and_evaluate`),
  with the budget's decision; says so when pruning removed nothing or the gates alone
  ended far from the budget."""
  if jax.process_count() > 1:
    host_variables = multihost_utils.process_allgather(variables, tiled=True)
  else:
    host_variables = jax.device_get(variables)
  results = exported_model.export_and_evaluate(
      workdir / exported_model.EXPORT_DIR, setup.run, setup.lm.cfg, host_variables,
      corpus, setup.mesh)
  results["budget"] = budget_decision(workdir) if setup.penalty.allowed is not None else None
  results["warnings"] = _pruning_warnings(setup, sum(results["heads_per_layer"]),
                                          results["budget"], gate_flags)
  if jax.process_index() == 0:
    print(_results_line("exported model", results, corpus.metric), flush=True)
    for warning in results["warnings"]:
      print(f"warning: {warning}", flush=True)
  return results


def _pruning_warnings(setup: run_setup.RunSetup, kept: int, decision: dict | None,
                      gate_flags: str) -> list[str]:
  """What a user should know about a pruning run's outcome, with the flag to turn."""
  total = sum(setup.lm.cfg.layer_heads)
  gates = setup.run.gates
  # Every caller's train section sits beside its gates section, with the same prefix.
  train_flags = gate_flags.replace("gates", "train")
  if decision is None:
    if kept < total:
      return []
    return [f"pruning removed no head of {total} (λ={gates.lam}). Ask for a size with "
            f"{gate_flags}.target_sparsity=0.5 (or target_params, target_macs), or "
            f"raise {gate_flags}.lam."]
  if decision["allowed"] == total:
    key = cost_model.target_key(setup.run)
    return [f"the budget {gate_flags}.{key}={getattr(gates, key)} allows all {total} heads, so "
            "pruning removed none; ask for a smaller size."]
  if abs(decision["by_gates"] - decision["allowed"]) >= max(2, total // 10):
    return [f"the gates alone kept {decision['by_gates']} heads at the freeze, far from "
            f"the budget's {decision['allowed']}; the budget chose {decision['changed']} "
            "heads by logit rank. To let the gates decide, give them more steps to settle "
            f"before they freeze: a later {gate_flags}.freeze_step (now "
            f"{gates.freeze_step}, with {train_flags}.num_steps after it), or a longer target "
            f"warm-up, {gate_flags}.budget_warmup_steps (now "
            f"{budget.target_warmup_steps(gates.budget_warmup_steps, gates.freeze_step)})."]
  return []


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


def _progress_line(step: int, num_steps: int, steps_per_s: float, summary: dict,
                   metric: str, num_heads: int) -> str:
  """'step  100/2500  bpc 2.9045  loss 2.0133  12.3 steps/s  ETA 3m15s', plus the open
  heads and λ of a pruning run (`num_heads` > 0)."""
  line = (f"step {step:{len(str(num_steps))}d}/{num_steps}  {metric} {summary[metric]:.4f}  "
          f"loss {summary['loss']:.4f}  {steps_per_s:.1f} steps/s  "
          f"ETA {console.duration((num_steps - step) / steps_per_s)}")
  if num_heads:
    line += (f"  open heads {summary['open_actual/total']:.1f}/{num_heads}  "
             f"λ {summary['lambda']:.4g}")
  return line


def _results_line(name: str, results: dict, metric: str) -> str:
  return f"{name}: valid {metric} {results['valid']:.4f}  test {metric} {results['test']:.4f}"


def _summarise(pending, metric: str, gated: bool) -> dict[str, float]:
  """Means over the logging interval; per-layer vectors become one scalar per layer."""
  fetched = jax.device_get(pending)
  summary = {}
  for key in fetched[0]:
    if not gated and key in GATE_METRICS:
      continue
    mean = np.mean([m[key] for m in fetched], axis=0)
    if np.ndim(mean):
      summary.update({f"{key}/layer_{i}": float(v) for i, v in enumerate(mean)})
      summary[f"{key}/total"] = float(np.sum(mean))
    else:
      summary[key] = float(mean)
  summary[metric] = evaluation.metric_value(summary["nll"], metric)
  return summary


def _append_gate_history(workdir, step, gates, cfg: model_lib.ModelConfig) -> None:
  """Per-layer, per-head probabilities that the gate is open in the forward pass (the
  deterministic rule keeps a hard gate iff it is >= 1/2), for the gates heat map."""
  open_probability = lambda logits_H: gates_lib.forward_open_probability(
      jnp.asarray(logits_H), cfg.gate)
  probs = [np.asarray(open_probability(g["attention"]["logits"])).tolist() if g else []
           for g in _layer_gates(jax.device_get(gates), cfg.num_layers)]
  with (rundir.run_path(workdir) / rundir.GATE_HISTORY_FILE).open("a") as f:
    f.write(json.dumps({"step": step, "open_prob": probs}) + "\n")
