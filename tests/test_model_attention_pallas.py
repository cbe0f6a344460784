"""The fused Pallas attention core against the XLA path (CPU, Pallas' interpret mode).

Outputs and every gradient to 1e-5 in float32, with the same dropout masks, on shapes
that are not multiples of the tiles and span several of them in every direction; the
model's log-probabilities and accumulated train-step updates with either core; the
kernels' lowering for the GPU; sharded over a mesh; the choice of core, its errors
and the trial behind 'auto'.
"""
import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from allatt_jax.model.attention import relative
from allatt_jax.model.attention import core_choice
from allatt_jax.model.attention import xla_core
from allatt_jax.model.attention import pallas_core
from allatt_jax.model.attention import pallas_kernels
from allatt_jax.config import config_base
from allatt_jax.training import config_checks
from allatt_jax.model import transformer as model_lib
from allatt_jax.config import run_config
from allatt_jax.config.errors import ConfigError

import helpers

REPO = pathlib.Path(__file__).resolve().parents[1]
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
KEYS = jnp.array([[5, 6], [7, 8]], jnp.uint32)
SMALL_TILES = pallas_core.Blocks(rows=16, slots=16, batch=2)


@pytest.fixture
def kernels_run_here(monkeypatch):
  """The kernels count as runnable here, in interpret mode (also on a GPU, where
  compiled they would compute in TF32, not float32)."""
  monkeypatch.setattr(core_choice, "_why_not_here", lambda: None)
  monkeypatch.setattr(pallas_core, "_interpreted", lambda: True)


def core_inputs(h=2, b=4, t=20, s=13, n=40, dh=12, mem_valid=5, same_length=True):
  """(qu, qv, qp, k, v, r_pad, pk, pv), the mask and an output cotangent."""
  k = s + t
  rng = np.random.default_rng(0)   # NumPy: no compiles for the inputs
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  args = (normal(h, b, t, dh), normal(h, b, t, dh), normal(h, b, t, dh) if n else None,
          normal(h, b, k, dh), normal(h, b, k, dh),
          jnp.asarray(np.pad(rng.standard_normal((h, k, dh)), [(0, 0), (1, 0), (0, 0)]),
                      jnp.float32),
          normal(h, n, dh) if n else None, normal(h, n, dh) if n else None)
  mask = np.asarray(relative.attention_mask(t, s, jnp.int32(mem_valid), same_length))
  return args, jnp.asarray(mask), normal(h, b, t, dh)


def outputs_and_grads(core, args, mask, dout, rate):
  keys = KEYS if rate else None
  out, vjp = jax.vjp(lambda *a: core(rate, *a, mask, keys), *args)
  return out, vjp(dout)


def xla_path(rate, *args):
  return xla_core.attend(rate, 1, False, jnp.float32, *args)


@pytest.mark.parametrize("case", [
    # Several tiles along queries (20 = 16 + 4), keys (33), slots (40) and batch rows
    # (4 = 2 x 2), head size 12 padded to 16; memory partly empty, dropout on.
    dict(shape={}, rate=0.3, blocks=SMALL_TILES),
    # A stream's start: no memory yet, so whole key tiles are seen by no query.
    dict(shape=dict(mem_valid=0), rate=0.3, blocks=SMALL_TILES),
    # Transformer-XL (no persistent slots), full memory, no window, no dropout.
    dict(shape=dict(n=0, mem_valid=13, same_length=False), rate=0.0, blocks=SMALL_TILES),
    # The default tiles of a short segment: one tile holds all queries and keys.
    dict(shape=dict(h=3, b=2, t=5, s=4, n=6, dh=8, mem_valid=2), rate=0.3, blocks=None),
], ids=["tiles", "stream_start", "txl", "default_tiles"])
def test_kernels_match_xla_path(case):
  args, mask, dout = core_inputs(**case["shape"])
  kernel_core = functools.partial(pallas_core.attend, blocks=case["blocks"],
                                  interpret=True)
  run = lambda core: jax.jit(functools.partial(outputs_and_grads, core, rate=case["rate"]))(
      args, mask, dout)
  (out, grads), (expected_out, expected_grads) = run(kernel_core), run(xla_path)
  np.testing.assert_allclose(out, expected_out, **TOLERANCE)
  names = ("qu", "qv", "qp", "k", "v", "r_pad", "pk", "pv")
  for name, got, expected in zip(names, grads, expected_grads):
    if expected is None:
      assert got is None, name
    else:
      np.testing.assert_allclose(got, expected, **TOLERANCE, err_msg=name)


def test_dropout_drops_the_same_weights():
  """With one-hot values the outputs are the dropped weights themselves."""
  (qu, qv, qp, k, _, r_pad, pk, _), mask, _ = core_inputs(h=1, b=2, t=5, s=4, n=7, dh=4)
  h, b, kk, _ = k.shape
  n = pk.shape[1]
  eye = jnp.eye(kk + n)
  v, pv = jnp.broadcast_to(eye[:kk], (h, b, kk, kk + n)), jnp.broadcast_to(eye[kk:], (h, n, kk + n))
  wide = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, kk + n - x.shape[-1])])
  inputs = (wide(qu), wide(qv), wide(qp), wide(k), v, wide(r_pad), wide(pk), pv, mask, KEYS)
  dropped = jax.jit(functools.partial(pallas_core.attend, 0.5, interpret=True))(*inputs)
  expected = jax.jit(functools.partial(xla_path, 0.5))(*inputs)
  assert 0.3 < float(jnp.mean(expected == 0)) < 0.7
  np.testing.assert_array_equal(dropped == 0, expected == 0)
  np.testing.assert_allclose(dropped, expected, **TOLERANCE)


@pytest.mark.parametrize("same_length", [False, True])
@pytest.mark.parametrize("keys", relative.SAME_LENGTH_KEYS)
def test_mask_rows_are_the_intervals_the_kernels_read(same_length, keys):
  t, s = 7, 5
  for mem_valid in range(s + 1):
    mask = np.asarray(relative.attention_mask(t, s, jnp.int32(mem_valid), same_length, keys))
    geometry = pallas_kernels.Geometry(
        t=t, k=s + t, n=0, dh=8, rows=16, slots=16, batch_block=1, rate=0.0,
        interpret=True)
    (lo, hi), _, _ = pallas_core._mask_bounds(jnp.asarray(mask), geometry)
    j = np.arange(s + t)
    np.testing.assert_array_equal((j >= lo[:t, None]) & (j <= hi[:t, None]), mask)


def test_kernels_lower_for_the_gpu():
  """The Triton lowering accepts every kernel (tile shapes, primitives), forward and
  backward, in bf16 with dropout; compiling it needs a GPU."""
  args, mask, _ = core_inputs(h=2, b=2, t=24, s=8, n=20, dh=12)
  args = [x.astype(jnp.bfloat16) for x in args]
  kernel_core = functools.partial(pallas_core.attend, blocks=SMALL_TILES,
                                  interpret=False)
  loss = lambda args: jnp.sum(kernel_core(0.2, *args, mask, KEYS).astype(jnp.float32))
  try:
    lowered = jax.jit(jax.grad(loss)).trace(args).lower(lowering_platforms=("cuda",))
  except ModuleNotFoundError as e:   # a jaxlib without the Triton dialect
    pytest.skip(str(e))
  text = lowered.as_text()
  for name in ("forward", "query_grads", "context_kv_grads", "slot_grads"):
    assert f"allatt_attention_{name}" in text
  assert text.count("__gpu$xla.gpu.triton") == 4


def test_choice_of_core_and_its_errors():
  # On a CPU: the XLA path; a model that asks for the kernels (one trained on a GPU,
  # read from disk) runs on it too, with a warning.
  assert not any(map(core_choice.use_kernel, core_choice.IMPLS))
  with pytest.raises(ConfigError, match=r"attention_impl='pallas'.*runs on cpu.*=auto.*=xla"):
    core_choice.check_runs_here("pallas")
  core_choice.check_runs_here("auto")
  config = config_base.base_config()
  config.model.vocab_size = 11
  config.model.attention_impl = "auto"
  config_checks.check_config(run_config.RunConfig.of(config), 1)   # 'auto' is fine
  config.model.attention_impl = "pallas"
  with pytest.raises(ConfigError) as error:
    config_checks.check_config(run_config.RunConfig.of(config), 1)
  assert "\n" not in str(error.value)
  config.model.attention_impl = "triton"
  with pytest.raises(ConfigError, match="attention_impl='triton' is unknown"):
    config_checks.check_config(run_config.RunConfig.of(config), 1)
  # A config.json saved before the key existed reads 'xla', the core its run used.
  saved = run_config.RunConfig.of(config_base.base_config()).to_dict()
  del saved["model"]["attention_impl"]
  assert run_config.RunConfig.from_dict(saved).model.attention_impl == "xla"


@pytest.mark.slow
def test_trial_runs_while_a_model_traces():
  """'auto' decides at the first trace: the trial problem runs eagerly from inside it
  and agrees with the XLA path (here in interpret mode)."""
  result = {}

  def traced(x):
    result["mismatch"] = core_choice.trial_mismatch(interpret=True)
    return x + 1

  jax.jit(traced)(1.0)
  assert result["mismatch"] is None


def tiny_model(**model):
  """An All-att model with its second layer pruned away and the first at 3 of 4 heads
  (head size 4, padded to 16 in the kernels), persistent slots and dropout."""
  return helpers.kernel_test_model(**{"heads_per_layer": (3, 0), "num_persistent": 9, **model})


def test_model_log_probs_match(kernels_run_here):
  config = tiny_model()
  tokens = np.random.default_rng(1).integers(0, 11, (2, 12))
  for got, expected in zip(helpers.stream_log_probs(config, "pallas", tokens),
                           helpers.stream_log_probs(config, "xla", tokens)):
    np.testing.assert_allclose(got, expected, **TOLERANCE)


def test_inference_paths_match(kernels_run_here):
  """Scoring a stream in segments (evaluation, the API, export's scores), greedy
  generation (one token at a time against the memory) and the layer outputs that
  distillation reads: the same with either core."""
  from allatt_jax.evaluation import likelihood   # pylint: disable=import-outside-toplevel
  from allatt_jax.evaluation import generation
  config = tiny_model(dropout=0.0, dropout_attn=0.0, dropout_emb=0.0)
  tokens = np.random.default_rng(3).integers(0, 11, 20)
  results = {}
  for impl in ("pallas", "xla"):
    lm = model_lib.TransformerLM.from_config(config, attention_impl=impl)
    memory = model_lib.init_memory(lm.cfg, 1, 5)
    variables = jax.jit(lm.init)(jax.random.key(0), tokens[None, :6], tokens[None, :6],
                                 memory)
    log_probs = likelihood.token_log_probs(lm, variables, tokens, seq_len=6, mem_len=5)
    generated = generation.Sampler(lm, seq_len=6, mem_len=5, temperature=0.0).generate(
        variables, tokens[:7], 4)
    _, layers = jax.jit(functools.partial(lm.apply, method=lm.distill_outputs,
                                          mutable=["intermediates"]))(
        variables, tokens[None, :6], tokens[None, 1:7], memory)
    results[impl] = (log_probs, generated, layers)
  np.testing.assert_allclose(results["pallas"][0], results["xla"][0], **TOLERANCE)
  np.testing.assert_array_equal(results["pallas"][1], results["xla"][1])
  for got, expected in zip(*(jax.tree.leaves(results[i][2]) for i in ("pallas", "xla"))):
    np.testing.assert_allclose(got, expected, **TOLERANCE)


def test_train_step_updates_match(kernels_run_here):
  """One accumulated train step (2 micro-batches) with dropout from a state with
  memory: every parameter's update (minus its gradient) is the same."""
  updates, metrics = {}, {}
  for impl in ("pallas", "xla"):
    updates[impl], metrics[impl] = helpers.accumulated_step(tiny_model(attention_impl=impl))()
  np.testing.assert_allclose(metrics["pallas"]["loss"], metrics["xla"]["loss"], **TOLERANCE)
  paths = jax.tree_util.tree_flatten_with_path(updates["xla"])[0]
  assert any("position_bias" in jax.tree_util.keystr(p) for p, _ in paths)
  for (path, expected), got in zip(paths, jax.tree.leaves(updates["pallas"])):
    np.testing.assert_allclose(got, expected, **TOLERANCE, err_msg=jax.tree_util.keystr(path))


_SHARDED = """
import functools, json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
sys.path.insert(0, sys.argv[1])
import test_model_attention_pallas as t
from allatt_jax.model.attention import pallas_core
from allatt_jax.parallel import sharding
mesh = sharding.make_mesh((2, 2))
args, mask, dout = t.core_inputs(h=4, b=4)
with jax.set_mesh(mesh):
  place = lambda x, spec: None if x is None else jax.device_put(x, NamedSharding(mesh, spec))
  args = [place(x, P("model", "data")) for x in args[:5]] + [place(x, P("model")) for x in args[5:]]
  kernel_core = functools.partial(pallas_core.attend, blocks=t.SMALL_TILES)
  got = jax.jit(functools.partial(t.outputs_and_grads, kernel_core, rate=0.3))(args, mask, dout)
  expected = jax.jit(functools.partial(t.outputs_and_grads, t.xla_path, rate=0.3))(args, mask, dout)
print(json.dumps(max(float(jnp.abs(a - b).max() / (1 + jnp.abs(b).max()))
                     for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)))))
"""


@pytest.mark.slow
def test_sharded_kernels_match_xla_path():
  """On a 2 x 2 mesh of CPU devices the kernels run per shard (shard_map), counting
  dropout positions over the whole array: the XLA path's values and gradients."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": helpers.xla_flags(cpu_devices=4)}
  result = subprocess.run([sys.executable, "-c", _SHARDED, str(REPO / "tests")], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert json.loads(result.stdout.strip().splitlines()[-1]) < 1e-5
