"""The runs behind the experiment suites, each an ordinary run in WORKDIR/runs/<name>.

Kinds: baseline, continued (the unpruned reference, trained on for a pruning run's
steps), l0, txl, heuristic (a masked export, then fine-tuned like continued), budget.
A finished run is read back, an unfinished one resumes; past a deadline or on SIGTERM
the run in progress checkpoints and no later one starts. Process 0 writes the files.
"""
from collections.abc import Mapping
import dataclasses
import json
import pathlib
import shutil
import time

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

from allatt_jax.runs import checkpointing
from allatt_jax.config import config_base
from allatt_jax.training import config_checks
from allatt_jax.pruning import model_export
from allatt_jax.pruning import cost_model
from allatt_jax.model import transformer as model_lib
from allatt_jax.training import preemption
from allatt_jax.training import assembly
from allatt_jax.config import run_config
from allatt_jax.runs import run_files
from allatt_jax.training import loop
from allatt_jax.runs import workdir_checks
from allatt_jax.config.errors import ConfigError
from allatt_jax.config.errors import Preempted
from allatt_jax.experiments import heuristics
from allatt_jax.experiments import plan as plan_lib
from allatt_jax.config.run_config import RunConfig

RESULTS_FILE = "results.json"
SUMMARY_FILE = "experiment.json"
MASK_FILE = "mask.json"

# Ablation variants of the paper's Table 3: which of the three techniques are off.
ABLATIONS = {
    "full": {},
    "no_warmup": {"l0_warmup_steps": 0},
    "no_init": {"init": 0.0},
    "no_scaling": {"scale_output": False},
    "vanilla": {"l0_warmup_steps": 0, "init": 0.0, "scale_output": False},
}


@dataclasses.dataclass
class Record:
  """What the suites tabulate about one finished run."""
  name: str
  kind: str                  # baseline | continued | l0 | txl | heuristic | budget
  metric: str                # 'bpc' or 'ppl'
  valid: float
  test: float
  heads_per_layer: list[int]
  persistent_per_layer: list[int]   # persistent slots kept, summed over each layer's heads
  params_non_embedding: int
  macs_per_token: float      # non-embedding, at the eval lengths
  d_model: int
  wall_s: float              # the run's wall time, training and evaluation
  extra: dict = dataclasses.field(default_factory=dict)

  @property
  def heads(self) -> int:
    return sum(self.heads_per_layer)


@dataclasses.dataclass(frozen=True)
class PlannedRun:
  """A run an experiment makes: its name, kind and config, and the experiment
  config's flags for the keys the plan sets in it ({'gates.lam':
  'experiments.lambdas', 'distill.weight': 'experiments.distill_variants.v.weight',
  ...}), which its errors name (`config_checks.named_as`)."""
  name: str
  kind: str
  config: RunConfig
  flags: Mapping[str, str]


class Experiment:
  """Creates, runs or reads back the runs of one baseline, plan and workdir.

  Heuristic runs and distilling budget runs read keys only an `ExperimentPlan` has.
  """

  def __init__(self, base: RunConfig, plan: plan_lib.Plan, workdir,
               deadline: float | None = None,
               watch: preemption.PreemptionWatch | None = None, *,
               read_data: bool = True):
    """`base`: a checked config (`assembly.checked_config`). `read_data`: read its
    dataset (once, for every run) and complete the config from it, as the runs are
    made; False: to list and `check` the runs only, before any data is read."""
    self.plan = plan
    self.deadline = deadline     # time.monotonic() value: stop training runs there
    self.watch = watch           # the command's: SIGTERM stops it between runs too
    self.workdir = pathlib.Path(workdir)
    # Completed from the dataset once (model.vocab_size), as every run saves it, so a
    # finished run's config.json compares like with like.
    self.base, self.corpus = (assembly.completed_config(base) if read_data
                              else (base, None))
    self.base_model = model_lib.ModelConfig.from_config(self.base)

  # --- Run configs: what each run changes from the baseline, and the flags that set it.

  def run_dir(self, name: str) -> pathlib.Path:
    return self.workdir / "runs" / name

  def _prune_train_flags(self) -> dict[str, str]:
    return {f"train.{key}": f"experiments.prune_train.{key}" for key in self.plan.prune_train}

  def _pruning_flags(self, gates: Mapping[str, str]) -> dict[str, str]:
    """The flags of a pruning run's keys: the plan's prune_train and prune_gates, and
    `gates` ({gates key: the experiments key it comes from})."""
    return {**self._prune_train_flags(),
            **{f"gates.{key}": f"experiments.prune_gates.{key}"
               for key in self.plan.prune_gates},
            **{f"gates.{key}": f"experiments.{flag}" for key, flag in gates.items()}}

  def continued_run(self, seed: int = 0) -> PlannedRun:
    return PlannedRun(f"continued_s{seed}", "continued", self._continued_config(seed),
                      self._prune_train_flags())

  def _continued_config(self, seed: int) -> RunConfig:
    return run_config.derived_run(
        self.base, init_from=str(self.run_dir("baseline")),
        train={**self.plan.prune_train, "seed": seed})

  def l0_run(self, lam: float, seed: int = 0, variant: str = "full",
             lam_key: str = "lambdas") -> PlannedRun:
    """The pruning run at λ `lam` (from the plan's `lam_key`) of an ablation variant."""
    config = self._l0_config(seed, lam=lam, **ABLATIONS[variant])
    return PlannedRun(f"l0_lam{lam:g}_{variant}_s{seed}", "l0", config,
                      self._pruning_flags({"lam": lam_key}))

  def _l0_config(self, seed: int, distill: str = "", **gates) -> RunConfig:
    return run_config.pruning_stage(
        self.base, str(self.run_dir("baseline")),
        train={**self.plan.prune_train, "seed": seed},
        gates={**self.plan.prune_gates, **gates},
        distill=self.plan.distill_variants[distill] if distill else None)

  def txl_run(self, width: int) -> PlannedRun:
    config = run_config.derived_run(self.base, model=config_base.txl_model(width))
    return PlannedRun(f"txl_d{width}", "txl", config,
                      {"model.d_model": "experiments.txl_widths",
                       "model.d_ff": "experiments.txl_widths"})

  def budget_run(self, key: str, fraction: float, seed: int = 0, distill: str = "",
                 values_key: str = "budgets", groups: str = "") -> PlannedRun:
    """A budget run; params and MAC budgets are fractions of the unpruned model's
    (from the plan's `values_key`). `distill` names one of the `distill_variants` (the
    baseline is the teacher). `groups`: '' (heads only), 'groups' (the plan's
    persistent groups only) or 'both' (heads and groups)."""
    # The plan's value as it is: a size in (0, 1) is a fraction of the unpruned
    # model's, which the run's checks resolve (and name, with advice as a fraction).
    flags = self._pruning_flags({key: values_key})
    gates = {}
    if groups:
      group = self.plan.persistent_group
      gates = dict(persistent_group=group, heads=groups == "both")
      flags["gates.persistent_group"] = "experiments.persistent_group"
    config = self._l0_config(seed, distill, lam=0.0, **{key: fraction}, **gates)
    kind = {"": "", "groups": f"_groups{gates.get('persistent_group')}",
            "both": f"_heads_groups{gates.get('persistent_group')}"}[groups]
    name = f"budget_{key.removeprefix('target_')}{fraction:g}{kind}_s{seed}"
    flags.update({f"distill.{k}": f"experiments.distill_variants.{distill}.{k}"
                  for k in (self.plan.distill_variants[distill] if distill else ())})
    return PlannedRun(f"{name}_distill_{distill}" if distill else name, "budget", config,
                      flags)

  def check(self, runs, suite: str) -> None:
    """Raises ConfigError for the first of `runs` (PlannedRun) whose config fails its
    checks (config_checks.py), naming the experiment config's flag that sets the key:
    made for every run of a suite before its first run trains."""
    for run in runs:
      try:
        checked = assembly.checked_config(run.config)
        if checked.init_source:   # the baseline's params, or a masked copy of them
          config_checks.check_from_baseline(self.base, checked)
      except ConfigError as e:
        raise ConfigError(f"--suite={suite}, run {run.name}: "
                          + config_checks.named_as(str(e), run.flags)) from None

  # --- Runs.

  def baseline(self) -> Record:
    return self._run("baseline", "baseline", self.base)

  def continued(self, seed: int = 0) -> Record:
    self.baseline()
    return self._made(self.continued_run(seed))

  def l0(self, lam: float, seed: int = 0, variant: str = "full") -> Record:
    self.baseline()
    record = self._made(self.l0_run(lam, seed, variant))
    record.extra.update(lam=lam, seed=seed, variant=variant)
    return record

  def txl(self, width: int) -> Record:
    return self._made(self.txl_run(width))

  def budget(self, key: str, fraction: float, seed: int = 0, distill: str = "",
             groups: str = "", values_key: str = "budgets") -> Record:
    """A budget run (`budget_run`)."""
    self.baseline()
    planned = self.budget_run(key, fraction, seed, distill, values_key, groups)
    config = assembly.checked_config(planned.config)   # a fraction made the figure
    record = self._run(planned.name, planned.kind, config)
    decision = json.loads((self.run_dir(record.name) / RESULTS_FILE).read_text()
                          )["export"].get("budget") or {}
    record.extra.update(target_key=key, fraction=fraction,
                        target=getattr(config.gates, key), seed=seed, distill=distill,
                        groups=groups,
                        target_heads=None if groups else cost_model.target_open_heads(
                            config, self.base_model),
                        by_gates=decision.get("by_gates"), changed=decision.get("changed"),
                        decision=decision)
    return record

  def heuristic(self, method: str, num_remove: int, seed: int = 0) -> tuple[Record, Record]:
    """(masked model as it is, masked model fine-tuned) for one method and size."""
    self.baseline()
    name = f"{method}_r{num_remove}_s{seed}"
    masked_dir = self.run_dir(f"{name}_masked")
    if not (masked_dir / RESULTS_FILE).is_file():
      self._export_masked(masked_dir, method, num_remove, seed)
    masked_config = run_files.load_config(masked_dir)
    masked = self._record(f"{name}_masked", "heuristic", masked_config,
                          json.loads((masked_dir / RESULTS_FILE).read_text()))
    # Made from the masked export, so not among the runs checked before the suite.
    config = assembly.checked_config(run_config.derived_run(
        self._continued_config(seed), init_from=str(masked_dir),
        model=dict(heads_per_layer=tuple(masked_config.model.heads_per_layer))))
    tuned = self._run(name, "heuristic", config)
    for record in (masked, tuned):
      record.extra.update(method=method, removed=num_remove, seed=seed)
    return masked, tuned

  # --- Machinery.

  def _made(self, planned: PlannedRun) -> Record:
    # Checked before the suite (`check`); resolved again here, so the run trains on
    # its budget's figure, not a fraction the plan may give.
    return self._run(planned.name, planned.kind, assembly.checked_config(planned.config))

  def _run(self, name: str, kind: str, config: RunConfig) -> Record:
    workdir = self.run_dir(name)
    results = None
    if (workdir / RESULTS_FILE).is_file():
      # A finished run is reused only for the settings it was trained with.
      workdir_checks.check_same_settings(config, workdir)
    else:
      if self.deadline is not None and time.monotonic() >= self.deadline:
        raise Preempted(f"Time box reached before run {name} started. Rerun the same "
                        "command to continue.")
      if self.watch is not None:
        self.watch.stop_if_asked("the runs before it", f"start run {name}")
      logging.info("Experiment run %s in %s", name, workdir)
      start = time.perf_counter()
      try:
        # What it wrote to RESULTS_FILE (which other processes may not see yet).
        results = loop.train_and_evaluate(
            assembly.prepared_run(config, self.corpus), workdir, self.deadline, self.watch,
            gate_flags="--config.experiments.prune_gates")
      finally:   # the run's wall time, summed over the slices that made it
        if workdir.is_dir():
          spent = _read_json(workdir / SUMMARY_FILE).get("wall_s", 0.0)
          _update_json(workdir / SUMMARY_FILE,
                       {"wall_s": spent + time.perf_counter() - start})
    if results is None:
      results = json.loads((workdir / RESULTS_FILE).read_text())
    if "export" in results:
      exported = run_files.load_config(results["export"]["directory"])
      return self._record(name, kind, exported,
                          {**results["export"], "metric": results["metric"]},
                          gated_test=results["test"])
    return self._record(name, kind, config, results)

  def _record(self, name, kind, config, results, **extra) -> Record:
    cfg = model_lib.ModelConfig.from_config(config)
    e = config.eval
    return Record(
        name=name, kind=kind, metric=results["metric"],
        valid=results["valid"], test=results["test"],
        heads_per_layer=list(cfg.layer_heads),
        persistent_per_layer=cfg.layer_slots,
        params_non_embedding=cost_model.param_counts(cfg)["params_non_embedding"],
        macs_per_token=cost_model.macs_per_token(
            cfg, e.seq_len, e.mem_len, e.batch_size)["macs_per_token_non_embedding"],
        d_model=cfg.d_model,
        wall_s=_read_json(self.run_dir(name) / SUMMARY_FILE).get("wall_s", 0.0), extra=extra)

  def _export_masked(self, directory: pathlib.Path, method: str, num_remove: int,
                     seed: int) -> None:
    """The baseline without the heads `method` removes, as an exported model
    (`model_export.export_and_evaluate`), with its mask and scores.

    The fine-tuning run starts from it through `init_from`, which takes exported
    models. What an interrupted call left is redone.
    """
    if jax.process_index() == 0:
      shutil.rmtree(directory, ignore_errors=True)
    _all_processes_reach(f"cleared {directory}")
    start = time.perf_counter()
    base_config, variables, _ = checkpointing.read_model(self.run_dir("baseline"))
    setup, corpus = assembly.run_setup(self.base), self.corpus
    train_cfg = self.base.train
    segments = heuristics.Segments.from_tokens(
        corpus.splits["train"], train_cfg.batch_size, train_cfg.seq_len,
        train_cfg.mem_len, self.plan.importance_batches)
    mask = heuristics.prune_mask(
        method, setup.lm, {"params": variables["params"]}, segments, num_remove, seed=seed,
        michel_step_fraction=self.plan.michel_step_fraction)
    results = model_export.export_and_evaluate(
        directory, base_config, setup.lm.cfg, {"params": variables["params"]}, corpus,
        setup.mesh, heads=mask)
    _write_json(directory / MASK_FILE,
                {"method": method, "removed": num_remove, "seed": seed,
                 "mask": [m.astype(int).tolist() for m in mask]})
    results["metric"] = corpus.metric
    _update_json(directory / SUMMARY_FILE, {"wall_s": time.perf_counter() - start})
    _write_json(directory / RESULTS_FILE, results)
    _all_processes_reach(f"saved {directory}")    # all read these files next


def _read_json(path: pathlib.Path) -> dict:
  return json.loads(path.read_text()) if path.is_file() else {}


def _update_json(path: pathlib.Path, values: dict) -> None:
  _write_json(path, {**_read_json(path), **values})


def _all_processes_reach(point: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(point)


def _write_json(path: pathlib.Path, value) -> None:
  if jax.process_index() == 0:
    run_files.write_json(path, value)


def mean_std(values) -> tuple[float, float]:
  values = np.asarray(list(values), np.float64)
  return float(values.mean()), float(values.std(ddof=1)) if values.size > 1 else 0.0
