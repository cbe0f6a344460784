"""Measured throughput of a config's model: train steps, pruned models' inference,
matmul peak.

`measure` times train steps (baseline, pruning, distilling) and their model GFLOP/s
(3 · 2 · forward MACs per token), inference of random models cut to fractions of their
heads against the ideal 1 / MAC ratio, and one matmul in the compute dtype (the peak),
in interleaved rounds (medians). Parameters and tokens are random: throughputs only.
"""
from collections.abc import Callable, Mapping
import dataclasses
import functools
import os
import resource
import statistics
import time
import types
from typing import Any

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from allatt_jax.perf import bench_report
from allatt_jax.perf import config_variants
from allatt_jax.perf import hlo_counts
from allatt_jax.model import transformer as model_lib
from allatt_jax.pruning import head_removal
from allatt_jax.training import assembly
from allatt_jax.config import run_config
from allatt_jax.config.errors import ConfigError
from allatt_jax.parallel import sharding
from allatt_jax.perf import step_profile
from allatt_jax.evaluation import stream_eval
from allatt_jax.config import typed_section
from allatt_jax.model import vocab_logsumexp


@dataclasses.dataclass(frozen=True)
class BenchmarkPlan:
  """How much the benchmark times: a config's `benchmark` section (configs/bench_cpu.py),
  over these defaults for what it leaves out (or for a config without one)."""
  train_steps: int = 5             # timed steps per train-step variant and round
  eval_segments: int = 5           # timed segments per exported model and round
  rounds: int = 5                  # variants alternate within a round; medians reported
  heads_kept: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25)
  matmul_size: int = 2048          # n of the n x n x n matmul taken as the peak
  profile: bool = False            # trace baseline steps after the rounds (step_profile)
  profile_steps: int = 3           # steps per trace
  gated_steps: bool = True         # also time the gated and the distilling train steps
  variant_evaluations: bool = True  # also time each variant's evaluation (all heads)
  # name -> {section: {key: value}}: configs timed beside this one (config_variants.py)
  variants: Mapping[str, Mapping[str, Any]] = dataclasses.field(
      default_factory=lambda: types.MappingProxyType({}))

  @classmethod
  def from_dict(cls, section) -> "BenchmarkPlan":
    """The plan of a config's `benchmark` section (a mapping, or a ConfigDict).

    Raises:
      ConfigError: a key the plan does not have, or a value of another type.
    """
    values = section.to_dict() if hasattr(section, "to_dict") else dict(section)
    return typed_section.read(cls, values, "--config.benchmark")

  def __post_init__(self):
    for key in ("train_steps", "eval_segments", "rounds", "profile_steps", "matmul_size"):
      if getattr(self, key) < 1:
        raise ConfigError(f"--config.benchmark.{key} is {getattr(self, key)}; it takes "
                          "a count of at least 1.")


# The distillation the benchmark times for configs that do not turn it on: both terms,
# so the teacher's whole cost shows.
DISTILL = dict(weight=0.5, temperature=1.0, hidden_weight=0.1)


def _timed(fn):
  start = time.perf_counter()
  result = jax.block_until_ready(fn())
  return result, time.perf_counter() - start


class _Usage:
  """Wall seconds, process CPU seconds (all threads) and minor page faults of a block.

  CPU seconds stay meaningful when other processes share the cores and stretch the
  wall time; page faults count fresh memory the step touched.
  """

  def __enter__(self):
    self._wall, self._usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    return self

  def __exit__(self, *exc):
    usage = resource.getrusage(resource.RUSAGE_SELF)
    self.wall = time.perf_counter() - self._wall
    self.cpu = (usage.ru_utime + usage.ru_stime
                - self._usage.ru_utime - self._usage.ru_stime)
    self.faults = usage.ru_minflt - self._usage.ru_minflt


class Matmul:
  """One n x n x n matmul: the device's practical peak GFLOP/s in that dtype."""

  def __init__(self, n: int, dtype=jnp.float32):
    self.n = n
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    self._args = (a, jax.random.normal(jax.random.key(1), (n, n), dtype))
    self._fn = jax.jit(jnp.matmul)
    jax.block_until_ready(self._fn(*self._args))

  def gflops(self, repeats: int = 3) -> tuple[float, float]:
    """(GFLOP per wall second, GFLOP per CPU second) of the fastest of `repeats`."""
    runs = []
    for _ in range(repeats):
      with _Usage() as usage:
        jax.block_until_ready(self._fn(*self._args))
      runs.append(usage)
    best = min(runs, key=lambda u: u.wall)
    flops = 2 * self.n ** 3 / 1e9
    return flops / best.wall, flops / max(best.cpu, 1e-9)


class TrainStep:
  """The real jitted train step on a fresh state, fed one fixed random batch."""

  def __init__(self, config: run_config.RunConfig, *, gated: bool,
               distill: bool = False, like: "TrainStep | None" = None):
    """`like`: a step whose state this one copies where their states have the same
    shapes, dtypes and shardings (a variant that changes how the model computes, not
    what it holds), which skips compiling the initialiser: on a GPU a large model's
    takes seconds to tens of seconds."""
    # Where the config does not distill, the distilling step is the benchmark's DISTILL.
    self.own_distill = distill and not config.distill.enabled
    if not distill:
      distill_keys = dict(weight=0.0, hidden_weight=0.0)
    else:
      distill_keys = DISTILL if self.own_distill else None
    config = run_config.derived_run(
        config, gates=dict(enabled=gated), distill=distill_keys,
        init_from="",   # a teacher starts as a copy of the random params
        # A setup refuses a gate freeze after the last step; the benchmark times a few
        # steps of a run whose freeze may lie beyond the config's step count.
        train=dict(num_steps=max(config.train.num_steps, config.gates.freeze_step)))
    self.config = config
    setup = assembly.run_setup(config)
    mesh = setup.mesh
    self.lm = setup.lm
    self._layout = _layout(setup)
    self._state = (jax.tree.map(jnp.copy, like._state)
                   if like is not None and like._layout == self._layout
                   else setup.new_state())
    batch = sharding.batch_sharding(mesh)
    train = config.train
    tokens = vocab_logsumexp.zipf_tokens(np.random.default_rng(0), config.model.vocab_size,
                                         (train.batch_size, train.seq_len + 1))
    self._batch = tuple(jax.device_put(a, batch) for a in (tokens[:, :-1], tokens[:, 1:]))
    step = setup.train_step(sample_gates=gated)
    self._mesh = mesh
    start = time.perf_counter()
    with sharding.activate(mesh):
      self._compiled = step.lower(self._state, *self._batch).compile()
    self.compile_s = time.perf_counter() - start
    self.run(1)   # the first call also allocates and warms up

  @property
  def tokens_per_step(self) -> int:
    return self.config.train.batch_size * self.config.train.seq_len

  @property
  def compiled(self) -> jax.stages.Compiled:
    """The compiled step: its optimized HLO, XLA's cost and memory analyses."""
    return self._compiled

  def run(self, num_steps: int) -> _Usage:
    """Usage of `num_steps` consecutive steps."""
    with sharding.activate(self._mesh), _Usage() as usage:
      for _ in range(num_steps):
        self._state, metrics = self._compiled(self._state, *self._batch)
      jax.block_until_ready((self._state, metrics))
    return usage

  def temp_bytes(self) -> int | None:
    analysis = self._compiled.memory_analysis()
    return getattr(analysis, "temp_size_in_bytes", None)

  @functools.cached_property
  def proxy(self) -> dict:
    """The compiled step's proxy figures (`hlo_counts.step_proxy`), walked once: a
    report is built after every round."""
    return hlo_counts.step_proxy(self._compiled, self.tokens_per_step)


def _layout(setup: assembly.RunSetup):
  """What a state must match to stand in for the setup's: each leaf's shape, dtype
  and sharding, in the tree's structure."""
  leaves, structure = jax.tree.flatten(setup.abstract_state)
  return structure, tuple((x.shape, x.dtype) for x in leaves), tuple(
      jax.tree.leaves(setup.state_sharding))


def random_model(config: run_config.RunConfig, seed: int = 0):
  """(config, variables) of the config's model, all its heads, random parameters.

  N(0, 0.02) entries of the right shapes: throughput does not depend on the values,
  and this skips compiling the initialisers.
  """
  cfg = model_lib.ModelConfig.from_config(config, gated=False, heads_per_layer=None)
  abstract = model_lib.abstract_variables(cfg)
  rng = np.random.default_rng(seed)
  return cfg, jax.tree.map(lambda a: rng.normal(0.0, 0.02, a.shape).astype(a.dtype),
                           nn.unbox(abstract))


def removed_heads(cfg: model_lib.ModelConfig, heads_kept: float,
                  seed: int = 0) -> dict[int, list[int]]:
  """{layer: heads} that leave round(heads_kept · H) random heads in every layer."""
  rng = np.random.default_rng(seed)
  return {i: rng.permutation(heads)[round(heads_kept * heads):].tolist()
          for i, heads in enumerate(cfg.layer_heads)}


class Inference:
  """Evaluation-with-memory throughput of one exported model on random tokens."""

  def __init__(self, config: run_config.RunConfig, model, heads_kept: float,
               segments: int):
    full_cfg, variables = model
    cfg, params = head_removal.remove_heads(full_cfg, variables,
                                            removed_heads(full_cfg, heads_kept))
    self.cfg = cfg
    self.heads_kept = heads_kept
    e = config.eval
    self.segments = segments
    mesh = sharding.run_mesh(config.mesh)
    self._evaluator = stream_eval.Evaluator.from_config(model_lib.TransformerLM(cfg), mesh,
                                                        config)
    self._variables = jax.device_put({"params": params})
    length = e.batch_size * e.seq_len * self.segments + 1
    self._tokens = vocab_logsumexp.zipf_tokens(np.random.default_rng(1), cfg.vocab_size,
                                               (length,))
    self.tokens_per_segment = e.batch_size * e.seq_len
    # The first segment compiles the step; its time less a steady segment's is the
    # compile time.
    _, self._first_s = _timed(self.warm)
    self.seconds = [self.run()]

  def warm(self) -> None:
    """One segment: the first call compiles the step; later ones, untimed, let a round
    time the steady state (see `run`)."""
    self._evaluator.score(self._variables, self._tokens, 1)

  def run(self) -> float:
    """Seconds per segment over the config's number of segments."""
    scored = self._evaluator.score(self._variables, self._tokens, self.segments)
    return self.tokens_per_segment / scored["tokens_per_s"]

  @property
  def compile_s(self) -> float:
    return self._first_s - min(self.seconds)

  def figures(self) -> dict:
    """Tokens/s (median of the timed rounds), each round's seconds per segment,
    compile time, and the compiled step's XLA temporaries and proxy figures
    (`hlo_counts.step_proxy`)."""
    return {"tokens_per_s": self.tokens_per_segment / statistics.median(self.seconds[1:]),
            "segment_s_rounds": self.seconds[1:], "compile_s": self.compile_s,
            **self._compiled_figures}

  @functools.cached_property
  def _compiled_figures(self) -> dict:
    compiled = self._evaluator.compiled_step(self._variables)   # compiled already
    return {"xla_temp_bytes": getattr(compiled.memory_analysis(), "temp_size_in_bytes", None),
            "proxy": hlo_counts.step_proxy(compiled, self.tokens_per_segment)}


def _ready(what: str, build):
  """build(), logged with its seconds as it finishes: on a GPU the compiles take most
  of a benchmark's minutes, and a run stopped at a time limit shows how far it got."""
  start = time.perf_counter()
  built = build()
  logging.info("benchmark: %s ready in %.1f s (compile %.1f s)", what,
               time.perf_counter() - start, built.compile_s)
  return built


def measure(config: run_config.RunConfig, plan: BenchmarkPlan,
            on_round: Callable[[dict], None] = lambda report: None,
            pruning: run_config.RunConfig | None = None) -> dict:
  """The benchmark report of `config`'s model (bench_report.py), timed as `plan` says
  (see the module docstring), with its variants' (config_variants.py) beside it.

  `on_round` is handed the report of the rounds so far after each round, so that a
  benchmark stopped at a time limit keeps what it measured.

  `pruning`: the run whose gated and distilling steps are timed, a pipeline's pruning
  stage (its gates, distillation and train section); by default `config` itself.

  Raises:
    ConfigError: a variant overrides a key the config lacks, or fails the config's
      checks (before anything compiles).
  """
  config = assembly.with_vocab_size(config)
  pruned = config if pruning is None else assembly.with_vocab_size(pruning)
  variant_configs = config_variants.resolve(config, plan.variants)
  load_before = os.getloadavg()
  matmul = Matmul(plan.matmul_size, jnp.dtype(config.model.dtype))
  train_steps = {"baseline": _ready("train step", lambda: TrainStep(config, gated=False))}
  if plan.gated_steps:
    train_steps.update(
        gated=_ready("gated train step", lambda: TrainStep(pruned, gated=True)),
        distill=_ready("distilling train step",
                       lambda: TrainStep(pruned, gated=True, distill=True)))
  model = random_model(config)
  models = [_ready(f"evaluation, {f:.0%} of the heads",
                   lambda f=f: Inference(config, model, f, plan.eval_segments))
            for f in plan.heads_kept]
  # Each variant's baseline step and its evaluation with all heads (or None).
  variants = {name: (_ready(f"variant {name}: train step",
                           lambda c=c: TrainStep(c, gated=False, like=train_steps["baseline"])),
                     _ready(f"variant {name}: evaluation", lambda c=c: Inference(
                         c, random_model(c), 1.0, plan.eval_segments))
                     if plan.variant_evaluations else None)
              for name, c in variant_configs.items()}
  timed = bench_report.Timed(config, plan, train_steps, models, variants, load_before,
                             pruning_stage=pruning is not None)
  steps = list(timed.usages)   # the config's train steps, then the variants'
  evaluations = [*models, *(e for _, e in variants.values() if e is not None)]

  # Each step's first step in a round runs untimed: after another executable has
  # run, it pays for fresh buffers and cold caches (6-26% slower at bench_cpu size, in
  # `first_step_in_round_s`), which back-to-back training steps never do.
  for i in range(plan.rounds):
    logging.info("benchmark: round %d of %d", i + 1, plan.rounds)
    order = lambda items: items[::-1] if i % 2 else items   # none goes first every round
    timed.peaks.append(matmul.gflops())
    for step in order(steps):
      timed.first_steps[step].append(step.run(1).wall)
      timed.usages[step].append(step.run(plan.train_steps))
    for model in order(evaluations):
      model.warm()
      model.seconds.append(model.run())
    report = bench_report.build(timed)   # its load average 'after' is read now
    on_round(report)

  # Traced after the rounds, so that tracing slows none of them.
  if plan.profile:
    logging.info("benchmark: tracing %d steps of each step profiled", plan.profile_steps)
    profiled = (train_steps["baseline"], *(step for step, _ in variants.values()))
    timed.profiles.update({step: step_profile.profile(step.run, step.compiled.as_text(),
                                                      plan.profile_steps)
                           for step in profiled})
    report = bench_report.build(timed)
  return report
