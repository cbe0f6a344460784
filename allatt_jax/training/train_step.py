"""The pure train step, and the train state it transforms.

With a `gates` collection in the state the loss gains the L0 term (`budget.Penalty`)
and gates are sampled (before the freeze) or deterministic (after); with a teacher,
the loss learns from it too. Everything besides the state and the batch (model,
optimizer, penalty, `StepConfig`) is built once at setup: the trace reads no config.
"""
import dataclasses
import functools
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from allatt_jax.pruning import budget
from allatt_jax.training import distill as distill_lib
from allatt_jax.model import transformer as model_lib
from allatt_jax.training import optim
from allatt_jax.config import run_config
from allatt_jax.parallel import sharding


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """The train step's constants: batch shape, seed, accumulation, non-finite policy,
  and the learning-rate schedules it reports."""
  batch_size: int
  seq_len: int
  mem_len: int
  seed: int
  grad_accum_steps: int
  skip_nonfinite_steps: bool
  learning_rate: optax.Schedule
  gate_learning_rate: optax.Schedule
  distill: run_config.DistillSection | None = None   # None: no teacher

  @classmethod
  def from_config(cls, config: run_config.RunConfig,
                  rates: optim.Schedules) -> "StepConfig":
    t = config.train
    distill = config.distill if config.distill.enabled else None
    return cls(batch_size=t.batch_size, seq_len=t.seq_len, mem_len=t.mem_len, seed=t.seed,
               grad_accum_steps=t.grad_accum_steps,
               skip_nonfinite_steps=t.skip_nonfinite_steps,
               learning_rate=rates.params, gate_learning_rate=rates.gates, distill=distill)


@flax.struct.dataclass
class TrainState:
  step: jax.Array                 # int32 scalar: updates applied so far
  variables: Any                  # {'params': ...} or {'params': ..., 'gates': ...}
  opt_state: Any
  memory: Any                     # model_lib memory of the training stream's rows
  # A distilling run's frozen teacher, {'params': ..., 'memory': ...} (its own memory
  # of the same rows); None otherwise. Saved with the state, so resume is exact.
  teacher: Any = None


def teacher_model(lm: model_lib.TransformerLM) -> model_lib.TransformerLM:
  """The teacher of a distilling run of `lm`: the same shapes, without gates."""
  return model_lib.TransformerLM(dataclasses.replace(lm.cfg, gated=False))


def init_state(lm: model_lib.TransformerLM, optimizer, penalty: budget.Penalty,
               step_config: StepConfig, rng, *, boxed=False):
  """A fresh state; `boxed` keeps logical-axis metadata (for eval_shape only).

  A teacher starts as a copy of the fresh params; a run replaces both with its
  `init_from` model's (assembly.RunSetup.new_state).
  """
  batch = step_config.batch_size
  tokens_BxT = jnp.zeros((batch, step_config.seq_len), jnp.int32)
  memory = model_lib.init_memory(lm.cfg, batch, step_config.mem_len)
  variables = lm.init({"params": rng}, tokens_BxT, tokens_BxT, memory)
  if not boxed:
    variables = nn.unbox(variables)
  variables = penalty.add_multipliers(flax.core.unfreeze(variables))
  teacher = None
  if step_config.distill is not None:
    teacher = {"params": jax.tree.map(jnp.copy, variables["params"]), "memory": memory}
  return TrainState(step=jnp.zeros((), jnp.int32), variables=variables,
                    opt_state=optimizer.init(variables), memory=memory, teacher=teacher)


def abstract_state(lm: model_lib.TransformerLM, optimizer, penalty: budget.Penalty,
                   step_config: StepConfig, mesh):
  """Shapes, dtypes and shardings of the train state, without allocating it.

  Returns (state of jax.ShapeDtypeStructs carrying their shardings, state shardings).
  """
  init = functools.partial(init_state, lm, optimizer, penalty, step_config, boxed=True)
  with sharding.activate(mesh):
    boxed = jax.eval_shape(init, jax.random.key(0))
  shardings = sharding.logical_shardings(mesh, boxed)
  shardings = shardings.replace(memory=sharding.memory_sharding(mesh))
  if shardings.teacher is not None:
    shardings = shardings.replace(teacher={**shardings.teacher,
                                           "memory": sharding.memory_sharding(mesh)})
  return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      nn.unbox(boxed), shardings), shardings


def _per_layer(stats, key):
  """Sum of a gate statistic per layer (0 for layers without heads or such gates)."""
  return jnp.stack([jnp.sum(s[key]) if key in s else jnp.zeros(()) for s in stats])


def _micro_batches(x, k):
  """(B, ...) -> (k, B/k, ...) taking rows i, i+k, ... for micro-batch i.

  Strided rather than contiguous, so each data-parallel shard holds rows of every
  micro-batch and the devices stay evenly loaded.
  """
  return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)


def _merge_micro_batches(x):
  return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def _micro_memory(memory, k):
  """A memory's hidden states (L, B, S, D) as (k, L, B/k, S, D), micro-batch first."""
  return jax.vmap(lambda x: _micro_batches(x, k), in_axes=0, out_axes=1)(memory["hidden"])


def _merged_memory(hidden_kxLxbxSxD, length):
  return {"hidden": jax.vmap(_merge_micro_batches, in_axes=1)(hidden_kxLxbxSxD),
          "length": length}


def train_step(state: TrainState, inputs_BxT, targets_BxT, *,
               lm: model_lib.TransformerLM, optimizer: optax.GradientTransformation,
               penalty: budget.Penalty, step_config: StepConfig, sample_gates: bool):
  """One optimizer update on a global batch (optionally accumulated over micro-batches).

  With `step_config.grad_accum_steps` = k > 1 the batch is scored as k micro-batches
  in sequence, each with its own rows' memory, and the mean of their gradients makes
  the same update as the full batch (up to float rounding, and to dropout masks, which
  differ per micro-batch).

  Raises:
    ConfigError: k does not divide the global batch (checked at trace time).
  """
  accum = step_config.grad_accum_steps
  sharding.check_accumulation(inputs_BxT.shape[0], accum)
  rng = jax.random.fold_in(jax.random.key(step_config.seed), state.step)
  gates_rng, dropout_rng = jax.random.split(rng)
  teacher = state.teacher
  # Frozen gates (and a budget's multipliers) take no more updates: the L0 term would
  # be a constant in the loss.
  trains_gates = sample_gates and "gates" in state.variables
  teacher_lm = teacher_model(lm) if teacher is not None else None

  def loss_fn(variables, inputs, targets, memory, teacher_memory, micro_index):
    kwargs = dict(deterministic=False, sample_gates=sample_gates,
                  # One gate sample per step, shared by all micro-batches, as for the
                  # full batch.
                  rngs={"gates": gates_rng,
                        "dropout": jax.random.fold_in(dropout_rng, micro_index)})
    if teacher is None:
      nll_BxT, new_memory, stats = lm.apply(variables, inputs, targets, memory, **kwargs)
      nll = nll_BxT.mean()
      loss, distilled = nll, {}
    else:
      (nll_BxT, clusters, new_memory, stats), hidden = lm.apply(
          variables, inputs, targets, memory, method=lm.distill_outputs,
          mutable="intermediates", **kwargs)
      # The teacher is frozen: in eval mode, and no gradient reaches its params.
      (_, teacher_clusters, teacher_memory, _), teacher_hidden = jax.lax.stop_gradient(
          teacher_lm.apply({"params": teacher["params"]}, inputs, targets, teacher_memory,
                           method=teacher_lm.distill_outputs, mutable="intermediates"))
      nll = nll_BxT.mean()
      loss, distilled = distill_lib.loss(
          step_config.distill, nll, clusters, teacher_clusters,
          hidden["intermediates"]["layer_outputs"],
          teacher_hidden["intermediates"]["layer_outputs"], lm.cfg.vocab_block)
    l0 = penalty.l0(stats) if "gates" in variables else jnp.zeros(())
    if trains_gates:
      loss += penalty(variables, l0, state.step)
    return loss, (nll, l0, new_memory, teacher_memory, stats, distilled)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  teacher_memory = None if teacher is None else teacher["memory"]
  if accum == 1:
    (loss, (nll, l0, memory, teacher_memory, stats, distilled)), grads = grad_fn(
        state.variables, inputs_BxT, targets_BxT, state.memory, teacher_memory, 0)
  else:
    micro = lambda x: _micro_batches(x, accum)
    length = state.memory["length"]
    teacher_hidden = None if teacher is None else _micro_memory(teacher_memory, accum)

    def accumulate(grad_sum, xs):
      inputs, targets, hidden, teacher_hidden, index = xs
      teacher_memory = (None if teacher_hidden is None else
                        {"hidden": teacher_hidden, "length": teacher["memory"]["length"]})
      (loss, (nll, l0, memory, teacher_memory, stats, distilled)), grads = grad_fn(
          state.variables, inputs, targets, {"hidden": hidden, "length": length},
          teacher_memory, index)
      grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
      return grad_sum, (loss, nll, l0, memory, teacher_memory, stats, distilled)

    zeros = jax.tree.map(jnp.zeros_like, state.variables)
    grads, (loss, nll, l0, memory, teacher_memory, stats, distilled) = jax.lax.scan(
        accumulate, zeros, (micro(inputs_BxT), micro(targets_BxT),
                            _micro_memory(state.memory, accum), teacher_hidden,
                            jnp.arange(accum)))
    grads = jax.tree.map(lambda g: g / accum, grads)
    loss, nll, l0 = loss.mean(), nll.mean(), l0[0]
    distilled = jax.tree.map(jnp.mean, distilled)
    memory = _merged_memory(memory["hidden"], memory["length"][0])
    if teacher is not None:
      teacher_memory = _merged_memory(teacher_memory["hidden"], teacher_memory["length"][0])
    stats = jax.tree.map(lambda s: s[0], stats)

  updates, opt_state = optimizer.update(grads, state.opt_state, state.variables,
                                        step=state.step)
  variables = optax.apply_updates(state.variables, updates)
  metrics = {
      "loss": loss, "nll": nll, "l0": l0, "lambda": penalty.lam(state.step),
      "grad_norm": optax.tree.norm(grads),
      "learning_rate": step_config.learning_rate(state.step),
      **({"gate_learning_rate": step_config.gate_learning_rate(state.step)}
         if "gates" in state.variables else {}),
      # The L0 term's value in the loss, as loss_fn added it (the same variables, count
      # and step), for the progress line to name the loss's terms.
      **({"penalty": penalty(state.variables, l0, state.step)} if trains_gates else {}),
      "open_expected": _per_layer(stats, "open_prob"),
      "open_actual": _per_layer(stats, "open"),
      **({"groups_open_actual": _per_layer(stats, "persistent_open")}
         if any("persistent_open" in s for s in stats) else {}),
      **penalty.metrics(state.variables, state.step),
      **distilled,
  }
  if step_config.skip_nonfinite_steps:
    # Decided on device, so skipping costs no host sync. The memories restart empty:
    # the hidden states of a step that overflowed may hold the overflow themselves.
    variables, opt_state, memory, teacher_memory = _where_finite(
        metrics, (variables, opt_state, memory, teacher_memory),
        (state.variables, state.opt_state, *jax.tree.map(jnp.zeros_like,
                                                         (memory, teacher_memory))))
  new_state = state.replace(step=state.step + 1, variables=variables, opt_state=opt_state,
                            memory=memory)
  if teacher is not None:
    new_state = new_state.replace(teacher={**teacher, "memory": teacher_memory})
  return new_state, metrics


def _where_finite(metrics, new, fallback):
  """`new` if the step's loss and gradient norm are finite, else `fallback`."""
  finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
  return jax.tree.map(lambda n, f: jnp.where(finite, n, f), new, fallback)


def jit_train_step(lm, optimizer, penalty, step_config, state_sharding, batch_sharding,
                   replicated, *, sample_gates: bool):
  step = functools.partial(train_step, lm=lm, optimizer=optimizer, penalty=penalty,
                           step_config=step_config, sample_gates=sample_gates)
  return jax.jit(step, in_shardings=(state_sharding, batch_sharding, batch_sharding),
                 out_shardings=(state_sharding, replicated), donate_argnums=(0,))
