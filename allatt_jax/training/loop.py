"""Training and pruning runs: the train loop, and the phases after it.

A run is a baseline run (no gates) or a pruning run (`gates.enabled`, usually with
`init_from` a baseline workdir). Restarting on the same workdir resumes from the
latest checkpoint, data position and memory included. The phases after training (the
final evaluation; a pruning run's export) each record their result in
PHASES_FILE when done, so a rerun after a preemption does not redo them.
"""
import json
import time

from absl import logging
import jax

from allatt_jax.pruning import freeze
from allatt_jax.runs import checkpointing
from allatt_jax import data as data_lib
from allatt_jax.pruning import model_export
from allatt_jax.pruning import gate_values
from allatt_jax.training import preemption
from allatt_jax.training import progress
from allatt_jax.training import assembly
from allatt_jax.runs import run_files
from allatt_jax.parallel import sharding
from allatt_jax.evaluation import stream_eval
from allatt_jax.runs import workdir_checks
from allatt_jax.config.errors import ConfigError
from allatt_jax.config.errors import Preempted

PHASES_FILE = "finished_phases.json"
BUDGET_FILE = "budget_decision.json"    # budget runs: the heads decided at the freeze


def train_and_evaluate(prepared: assembly.PreparedRun, workdir: str,
                       deadline: float | None = None,
                       watch: preemption.PreemptionWatch | None = None,
                       gate_flags: str = "--config.gates") -> dict:
  """Trains (or resumes) the run in `workdir` (`assembly.prepared_run`: its config
  checked and its dataset read before this opens the folder, so a wrong config or
  data folder leaves nothing behind); returns the final metrics.

  `gate_flags`: how the caller's command line names the gates section, for advice
  (a pipeline's pruning stage is set under --config.pipeline.prune_gates).

  On SIGTERM or Ctrl-C (`watch`: the calling command's, else the run's own) the run
  stops at the next safe point with Preempted: after the current step, with its
  checkpoint, or after the phase in progress. Past `deadline` (a time.monotonic() value) training
  stops as on SIGTERM. One process only: hosts would stop at different steps.
  """
  if deadline is not None and jax.process_count() > 1:
    raise ConfigError("A training deadline needs a single process.")
  workdir = run_files.run_path(workdir)
  setup, corpus = prepared.setup, prepared.corpus
  config = setup.run
  with preemption.watching(watch) as watch:
    # --- The workdir: checked, described, opened, and the state the run starts from.
    vocabulary = run_files.vocabulary_fingerprint(corpus.name, corpus.vocab)
    workdir_checks.check_run(config, setup.abstract_state, workdir, vocabulary)
    if jax.process_index() == 0:
      if prepared.note:
        print(prepared.note, flush=True)
      run_files.save_run(workdir, config, vocabulary, corpus.tokenizer.to_dict())
    source = run_files.run_path(config.init_source) if config.init_source else None
    # Whatever stops the run, the save in flight completes (or never counts).
    with checkpointing.RunCheckpoints(workdir, keep=config.checkpoint.keep) as checkpoints:
      if checkpoints.latest_step() is not None:
        resumed, state, data_state = checkpoints.restore_newest(setup.abstract_state)
        logging.info("Resuming from step %d in %s", resumed, checkpoints.directory)
      else:
        # A pruning run starts from the params of `init_from` (a run or an exported
        # model), whose shapes `check_run` checked; its gates and optimizer start
        # fresh.
        params = checkpointing.read_variables(source)[0]["params"] if source else None
        state, data_state = setup.new_state(params), None
      return _train_and_evaluate(setup, workdir, checkpoints, state, data_state, corpus,
                                 deadline, watch, gate_flags)


def _train_and_evaluate(setup: assembly.RunSetup, workdir,
                        checkpoints: checkpointing.RunCheckpoints, state,
                        data_state: dict | None, corpus: data_lib.Corpus,
                        deadline: float | None, watch: preemption.PreemptionWatch,
                        gate_flags: str) -> dict:
  """The train loop from `state` (and the data stream from `data_state`, None when
  the run starts fresh), then the phases after it."""
  config = setup.run
  train_cfg = config.train
  is_main = jax.process_index() == 0
  stream = data_lib.SegmentStream(corpus.splits["train"], train_cfg.batch_size,
                                  train_cfg.seq_len, *setup.rows)
  if data_state is not None:
    stream.set_state(data_state)
  gated = setup.lm.cfg.gated
  # Phase results count only for the state they were computed from: the last step's,
  # evaluated as the eval section says.
  phases_key = {"step": train_cfg.num_steps, "eval": config.eval.to_dict()}
  phases_path = workdir / PHASES_FILE
  phases = (json.loads(phases_path.read_text())
            if int(state.step) == train_cfg.num_steps and phases_path.is_file() else {})
  if phases.get("key") != phases_key:
    phases = {"key": phases_key}

  progress_log = progress.TrainProgress(
      workdir, setup.lm.cfg, num_steps=train_cfg.num_steps, first_step=int(state.step),
      tokens_per_step=train_cfg.batch_size * train_cfg.seq_len, metric=corpus.metric,
      skip_nonfinite=train_cfg.skip_nonfinite_steps, gated=gated,
      freeze_step=config.gates.freeze_step)
  budgeted = setup.penalty.allowed is not None
  freeze_step = config.gates.freeze_step

  # A budget decides the heads (and groups) kept on the state of its freeze, before
  # anything logs, evaluates or saves that state: so every checkpoint from the freeze
  # on, the last one included, holds the decided gates. Idempotent: a run resumed at
  # its freeze (or a rerun of a finished run whose gates froze with its last step)
  # decides the same again and changes nothing.
  def decided(state, step: int):
    if budgeted and step == freeze_step:
      return _keep_budgeted_heads(setup, workdir, state, step)
    return state

  # --- Train loop. Metrics stay on device until a log, evaluation or save reads them.
  state = decided(state, int(state.step))
  try:
    for step in range(int(state.step), train_cfg.num_steps):
      state, metrics = setup.loop_steps[gated and step < freeze_step](state, *next(stream))
      done = step + 1
      state = decided(state, done)
      progress_log.add(done, metrics)

      log = done % train_cfg.log_every_steps == 0 or done == train_cfg.num_steps
      evaluate_now = bool(config.eval.every_steps) and done % config.eval.every_steps == 0
      save = done % config.checkpoint.every_steps == 0 or done == train_cfg.num_steps
      out_of_time = deadline is not None and time.monotonic() >= deadline
      signalled = watch.reached()
      preempted = signalled or out_of_time
      if log or evaluate_now or save or preempted:
        try:
          nonfinite = progress_log.fetch(done)
        except progress.NonFiniteStep as e:
          checkpoints.wait()
          raise e.error(checkpoints.latest_step()) from None
      if log:
        progress_log.log(done, nonfinite, state.variables.get("gates"))
      if evaluate_now:
        progress_log.write_eval(done, stream_eval.evaluate_splits(
            setup.evaluator, state.variables, corpus, ("valid",), config.eval.max_batches))
      if save or preempted:
        checkpoints.save(done, state, stream.get_state(), force=True)
      if preempted:
        checkpoints.wait()
        saved = (f": saved a checkpoint at step {done} of {train_cfg.num_steps} in "
                 f"{checkpoints.directory}. Rerun the same command to resume.")
        raise (watch.stopped(saved) if signalled else Preempted(f"Time box reached{saved}"))
  finally:
    progress_log.close()

  # --- Phases after training, each skipped if a run before this one finished it.
  watch.stop_if_asked(f"training (checkpoint of step {train_cfg.num_steps} in "
                      f"{checkpoints.directory})", "run the final evaluation")
  if "final" not in phases:
    phases["final"] = stream_eval.evaluate_splits(setup.evaluator, state.variables, corpus)
    progress_log.write_final(train_cfg.num_steps, phases["final"])
    if is_main:
      run_files.write_json(phases_path, phases)
  if is_main:
    print(stream_eval.results_line("final" + (" (gated)" if gated else ""), phases["final"],
                                   corpus.metric), flush=True)
  next_phase = "export the pruned model" if gated else "write results.json"
  watch.stop_if_asked(f"the final evaluation (kept in {phases_path})", next_phase)
  if gated:
    if "export" not in phases:
      # Sharded over processes, maybe: every host gathers the whole model.
      variables = sharding.on_host(state.variables)
      phases["export"] = model_export.export_pruning_run(
          workdir, config, setup.lm.cfg, variables, corpus, setup.mesh,
          decision=budget_decision(workdir) if budgeted else None, gate_flags=gate_flags)
      if is_main:
        run_files.write_json(phases_path, phases)
    watch.stop_if_asked(f"the export to {phases['export']['directory']}",
                        "write results.json")
  results = {**phases["final"], "metric": corpus.metric}
  if gated:
    results["export"] = phases["export"]
  if is_main:
    run_files.write_json(workdir / "results.json", results)
  return results


def _keep_budgeted_heads(setup: assembly.RunSetup, workdir, state, step: int):
  """The state with exactly the heads (and persistent groups) the budget keeps
  (`freeze.keep_budgeted`), the decision recorded in BUDGET_FILE and on the
  console.

  Made when the gates freeze, so the last steps train the model at its final size.
  """
  cfg = setup.lm.cfg
  host_gates = sharding.on_host(state.variables["gates"])
  gates = gate_values.read(cfg, host_gates)
  new_gates, decision, line = freeze.keep_budgeted(cfg, gates, setup.penalty)
  path = workdir / BUDGET_FILE
  if decision["changed"] or not path.is_file():
    if jax.process_index() == 0:
      print(line, flush=True)
      run_files.write_json(path, {"step": step, **decision})
  if not decision["changed"]:
    return state
  new_gates = jax.device_put(new_gates, setup.state_sharding.variables["gates"])
  return state.replace(variables={**state.variables, "gates": new_gates})


def budget_decision(workdir) -> dict | None:
  """What the budget decided at the freeze (`_keep_budgeted_heads`), or None."""
  path = run_files.run_path(workdir) / BUDGET_FILE
  return json.loads(path.read_text()) if path.is_file() else None
