"""The split core (split_core.py) against the XLA core, on CPU.

The split core computes what `xla_core.attend` computes, in float32 to the
round-off of a reordered sum: outputs and every gradient (q through both bias paths
and the persistent queries, k, v, the position table, persistent keys and values,
slot weights) within 1e-6 of each array's largest value plus 1e-6 of each element's,
with the same dropout masks; each as close to a float64 reference as the XLA core
is. Also: every part draws the XLA core's dropout masks; the model's log-probabilities
and an accumulated train step; pruned layers of uneven head counts, a stream start,
slot weights (a closed slot takes no mass); the Pallas part in interpret mode and the
cuDNN part's plumbing (against a stand-in for cuDNN) against the XLA part; a 2 × 2
mesh; the choices of part and their refusals.
"""
import dataclasses
import functools
import inspect
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from allatt_jax.model.attention import relative
from allatt_jax.model.attention import core_choice
from allatt_jax.model.attention import xla_core
from allatt_jax.config import config_base
from allatt_jax.training import config_checks
from allatt_jax.perf import gpu_compile
from allatt_jax.perf import gpu_pieces
from allatt_jax.model.attention import dropout_mask
from allatt_jax.model import transformer as model_lib
from allatt_jax.model.attention import persistent_cores
from allatt_jax.model.attention import persistent_cudnn
from allatt_jax.model.attention import persistent_pallas
from allatt_jax.model.attention import persistent_trial
from allatt_jax.config import run_config
from allatt_jax.model.attention import split_core
from allatt_jax.config.errors import ConfigError
from allatt_jax.runs import checkpointing

import data_fixtures
import helpers

REPO = pathlib.Path(__file__).resolve().parents[1]
KEYS = np.array([[5, 6], [7, 8]], np.uint32)
NAMES = ("out", "qu", "qv", "qp", "k", "v", "r_pad", "pk", "pv", "pw")
SMALL_TILES = persistent_pallas.Tiles(rows=8, slots=32, chunks=2)


def assert_close(got, expected, err_msg="", tolerance=1e-6):
  """Within `tolerance` of the array's largest value plus `tolerance` of each element:
  float32 round-off of sums taken in another order."""
  got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
  np.testing.assert_allclose(got, expected, rtol=tolerance,
                             atol=tolerance * np.abs(expected).max(), err_msg=err_msg)


def core_inputs(h=2, b=3, t=7, s=5, n=40, dh=8, mem_valid=3, closed=None, closed_scale=1.0):
  """(qu, qv, qp, k, v, r_pad, pk, pv, pw) as float32 NumPy arrays, the mask and an
  output cotangent. `closed`: None (no slot weights), or 'groups' (every third slot
  closed) or 'head' (also every slot of head 0); the keys of every third slot times
  `closed_scale`."""
  k = s + t
  rng = np.random.default_rng(0)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  pw = None
  if closed:
    pw = (np.arange(n) % 3 != 0)[None].repeat(h, 0).astype(np.float32)
    if closed == "head":
      pw[0] = 0.0
  args = (normal(h, b, t, dh), normal(h, b, t, dh), normal(h, b, t, dh), normal(h, b, k, dh),
          normal(h, b, k, dh), np.pad(normal(h, k, dh), [(0, 0), (1, 0), (0, 0)]),
          normal(h, n, dh), normal(h, n, dh), pw)
  args[6][:, np.arange(n) % 3 == 0] *= closed_scale
  mask = np.asarray(relative.attention_mask(t, s, jnp.int32(mem_valid), True))
  return args, mask, normal(h, b, t, dh)


def outputs_and_grads(core, rate, args, mask, dout):
  """(out, *gradients of every input) of `core(*args[:8], mask, keys, pw)`."""
  keys = KEYS if rate else None
  out, vjp = jax.vjp(lambda *a: core(*a[:8], mask, keys, a[8]), *args)
  return (out, *vjp(dout))


def run_cores(split, xla, rate, args, mask, dout):
  run = lambda core: jax.jit(functools.partial(outputs_and_grads, core, rate))(
      args, mask, dout)
  return run(split), run(xla)


def assert_all_close(got, expected, tolerance=1e-6):
  for name, g, e in zip(NAMES, got, expected):
    if e is None:
      assert g is None, name
    else:
      assert_close(g, e, name, tolerance)


@pytest.mark.parametrize("case", [
    dict(rate=0.0, block=1, remat=False, shape={}),
    dict(rate=0.3, block=2, remat=True, shape={}),
    # A stream's start: the memory holds nothing yet.
    dict(rate=0.3, block=1, remat=False, shape=dict(mem_valid=0)),
    # Slot weights: closed slots take no mass, a head with every slot closed is the
    # context's alone.
    dict(rate=0.0, block=2, remat=False, shape=dict(closed="groups")),
    dict(rate=0.3, block=1, remat=True, shape=dict(closed="head", h=3)),
    # Closed slots scoring hundreds above the open ones: the shift is the open slots'
    # (with theirs, every open exponential and the merged sum would underflow to 0).
    dict(rate=0.0, block=2, remat=False, shape=dict(closed="groups", closed_scale=100.0)),
], ids=["no_dropout", "dropout_remat", "stream_start", "slot_weights", "closed_head",
        "closed_slots_above_the_rest"])
def test_split_core_is_the_xla_core(case):
  args, mask, dout = core_inputs(**case["shape"])
  rate, block, remat = case["rate"], case["block"], case["remat"]
  got, expected = run_cores(
      functools.partial(split_core.attend, rate, block, remat, jnp.float32, persistent="xla"),
      functools.partial(xla_core.attend, rate, block, remat, jnp.float32),
      rate, args, mask, dout)
  assert all(np.all(np.isfinite(g)) for g in got if g is not None)
  assert_all_close(got, expected)


def _float64_reference(rate, qu, qv, qp, k, v, r_pad, pk, pv, mask, keys, pw):
  """The attention written plainly, one softmax over the concatenated scores (a
  slot's exponential times its weight); the XLA core's dropout masks."""
  content = jnp.einsum("hbtd,hbkd->hbtk", qu, k)
  ctx = jnp.where(mask, content + xla_core.rel_shift(
      jnp.einsum("hbtd,hkd->hbtk", qv, r_pad)), -jnp.inf)
  pers = jnp.einsum("hbtd,hnd->hbtn", qp, pk)
  scores = jnp.concatenate([ctx, pers], -1)
  weights = jnp.concatenate([jnp.ones_like(ctx), jnp.broadcast_to(pw[:, None, None], pers.shape)],
                            -1)
  e = weights * jnp.exp(scores - jax.lax.stop_gradient(scores.max(-1, keepdims=True)))
  p = e / e.sum(-1, keepdims=True)
  keep = jnp.concatenate([dropout_mask.keep_mask(keys[0], ctx.shape, rate),
                          dropout_mask.keep_mask(keys[1], pers.shape, rate)], -1)
  p = jnp.where(keep, p / (1 - rate), 0.0)
  kk = k.shape[2]
  return (jnp.einsum("hbtk,hbkd->hbtd", p[..., :kk], v)
          + jnp.einsum("hbtn,hnd->hbtd", p[..., kk:], pv))


def test_split_core_is_as_exact_as_the_xla_core():
  """Against a float64 reference: the split core's float32 results err no more than
  the XLA core's (their log-sum-exps as (max, sum) pairs; a single lse erred 3x more)."""
  rate = 0.3
  args, mask, dout = core_inputs(closed="groups")
  with jax.enable_x64(True):
    truth = jax.jit(functools.partial(outputs_and_grads,
                                      functools.partial(_float64_reference, rate), rate))(
        [x.astype(np.float64) for x in args], mask, dout.astype(np.float64))
    truth = [np.asarray(x) for x in truth]
  got, xla = run_cores(
      functools.partial(split_core.attend, rate, 1, False, jnp.float32, persistent="xla"),
      functools.partial(xla_core.attend, rate, 1, False, jnp.float32),
      rate, args, mask, dout)
  error = lambda results: np.array([np.abs(np.asarray(r, np.float64) - t).max() / np.abs(t).max()
                                    for r, t in zip(results, truth)])
  split_error, xla_error = error(got), error(xla)
  assert split_error.max() < 2e-6, split_error
  assert np.all(split_error <= 1.5 * xla_error + 2e-7), (split_error, xla_error)


def seeds(rate, qp, pk):
  """The persistent part's dropout seeds under KEYS[1], as the split core makes them."""
  if not rate:
    return None, None
  return (dropout_mask.row_seeds(KEYS[1], *qp.shape[:3]),
          dropout_mask.column_seeds(KEYS[1], pk.shape[1]))


@pytest.mark.parametrize("part", [persistent_cores.PARTS["xla"],
                                  persistent_cores.Part("pallas", SMALL_TILES)], ids=str)
def test_every_persistent_part_drops_the_xla_cores_weights(part):
  """Each slot's dropped weight read off a part's output: with equal scores (qp = 0)
  and one-hot values, out[n] = keep_n / ((1 − rate)·N), so out·(1 − rate)·N is the
  mask the part drew, over several tiles of rows and slots (15 rows in tiles of 8, 70
  slots in tiles of 32)."""
  rate, (h, b, t, n) = 0.3, (3, 3, 5, 70)
  qp = np.zeros((h, b, t, n), np.float32)
  one_hot = np.broadcast_to(np.eye(n, dtype=np.float32), (h, n, n))
  rows, columns = seeds(rate, qp, one_hot)
  acc, _, norm = jax.jit(functools.partial(part.forward, rate, h, jnp.float32))(
      qp, one_hot, one_hot, None, rows, columns)
  drawn = np.asarray(acc / norm[..., None]) * (1 - rate) * n
  np.testing.assert_allclose(drawn, np.round(drawn), atol=1e-5)
  np.testing.assert_array_equal(drawn.round() == 1,
                                dropout_mask.keep_mask(KEYS[1], (h, b, t, n), rate))


def assert_kept_fraction(keep, rate):
  """Within 3 sigma of 1 - rate (Bernoulli)."""
  sigma = np.sqrt(rate * (1 - rate) / keep.size)
  assert abs(float(np.mean(keep)) - (1 - rate)) < 3 * sigma, (np.mean(keep), sigma)


def tiny_model(**model):
  """An All-att model with uneven heads (3 and 2 of 4, as after pruning), persistent
  slots, dropout and gradient accumulation."""
  return helpers.kernel_test_model(**{"heads_per_layer": (3, 2), "num_persistent": 40, **model})


def test_masks_follow_the_step_key_and_differ_across_steps_and_layers(monkeypatch):
  """Each layer's persistent mask keeps 1 - rate of its weights; no two layers or
  steps draw the same mask."""
  masks = []
  def recording(key_2, num_heads, batch, length):
    rows = dropout_mask.row_seeds(key_2, num_heads, batch, length)
    keep = dropout_mask.kept(rows[..., None], dropout_mask.column_seeds(key_2, 512), 0.3)
    jax.debug.callback(lambda k: masks.append(np.asarray(k)), keep)
    return rows

  # The split core's own seeds: its context part draws through dropout_mask too.
  monkeypatch.setattr(split_core, "dropout_mask", types.SimpleNamespace(
      row_seeds=recording, column_seeds=dropout_mask.column_seeds))
  config = tiny_model(attention_impl="split", persistent_impl="xla", num_persistent=512)
  lm = model_lib.TransformerLM.from_config(config)
  tokens = np.random.default_rng(1).integers(0, 11, (4, 7))
  memory = model_lib.init_memory(lm.cfg, 4, 5)
  variables = jax.jit(lm.init)(jax.random.key(0), tokens[:, :6], tokens[:, 1:], memory)
  step = jax.jit(lambda key: lm.apply(variables, tokens[:, :6], tokens[:, 1:], memory,
                                      deterministic=False, rngs={"dropout": key}))
  for key in range(2):
    jax.block_until_ready(step(jax.random.key(key)))
  jax.effects_barrier()
  assert len(masks) == 4   # 2 steps x 2 layers
  for keep in masks:
    assert_kept_fraction(keep, 0.3)
  for i in range(4):
    for j in range(i):
      n = min(masks[i].shape[0], masks[j].shape[0])   # uneven head counts
      assert np.mean(masks[i][:n] != masks[j][:n]) > 0.3


def test_model_log_probs_match():
  config = tiny_model()
  tokens = np.random.default_rng(1).integers(0, 11, (2, 12))
  for got, expected in zip(helpers.stream_log_probs(config, "split", tokens),
                           helpers.stream_log_probs(config, "xla", tokens)):
    assert_close(got, expected)


def test_model_with_closed_slot_groups_and_its_ragged_export_match():
  """Persistent-group gates (closed groups weight their slots 0) and the export that
  cuts them (heads keeping different numbers of slots, attended run by run)."""
  from allatt_jax.pruning import head_removal   # pylint: disable=import-outside-toplevel
  config = run_config.RunConfig.of(config_base.base_config())
  config = dataclasses.replace(
      tiny_model(heads_per_layer=None), gates=dataclasses.replace(
          config.gates, enabled=True, persistent_group=8, hard=True))
  tokens = np.random.default_rng(4).integers(0, 11, (2, 6))
  # Layer 0's head 1 and layer 1's head 3 with every group closed, others with some.
  logits = np.where(np.random.default_rng(5).random((2, 4, 5)) < 0.4, -3.0, 3.0)
  logits[0, 1] = logits[1, 3] = -3.0
  results = {}
  for impl in ("split", "xla"):
    lm = model_lib.TransformerLM.from_config(config, attention_impl=impl)
    memory = model_lib.init_memory(lm.cfg, 2, 5)
    variables = nn.unbox(jax.jit(lm.init)(jax.random.key(0), tokens, tokens, memory))
    for i in range(2):
      variables["gates"][f"layer_{i}"]["attention"]["persistent_logits"] = jnp.asarray(
          logits[i])
    gated = jax.jit(functools.partial(lm.apply, method=lm.log_probs))(variables, tokens,
                                                                      memory)[0]
    cfg, params = head_removal.remove_heads(lm.cfg, variables)
    export = model_lib.TransformerLM(dataclasses.replace(cfg, attention_impl=impl))
    cut = jax.jit(functools.partial(export.apply, method=export.log_probs))(
        {"params": params}, tokens, memory)[0]
    results[impl] = (gated, cut)
  assert len(set(cfg.persistent_slots[0])) > 1   # ragged: runs of heads
  for got, expected in zip(results["split"], results["xla"]):
    assert_close(got, expected)


@pytest.mark.slow
def test_accumulated_train_step_matches_and_repeats_bit_for_bit():
  """Every parameter's update (minus its gradient) as with the XLA core, dropout
  included; the step again, from the same state and key (a resumed run's), is
  bit-identical."""
  step_of = lambda impl: helpers.accumulated_step(
      tiny_model(attention_impl=impl, persistent_impl="xla"))
  split_step = step_of("split")
  updates, metrics = split_step()
  expected_updates, expected_metrics = step_of("xla")()
  assert_close(metrics["loss"], expected_metrics["loss"])
  paths = jax.tree_util.tree_flatten_with_path(expected_updates)[0]
  assert any("persistent_key" in jax.tree_util.keystr(p) for p, _ in paths)
  # Through two layers, their norms and the micro-batches' sum: 1e-5 (as the fused
  # kernels' test; observed ≤ 1.6e-6). The relative position projections' updates are
  # sums that cancel: the XLA core alone, compiled at XLA's default optimization level
  # instead of the tests' level 0, moves layer 0's by 5.7e-5 of its largest value on an
  # AVX-512 CPU, where the split core differs from it by 1.4e-5 (4e-6 on another CPU). A merged
  # statistic 0.1% off (δ, or the persistent part's scale) moves an update by 1e-3.
  for (path, expected), got in zip(paths, jax.tree.leaves(updates)):
    name = jax.tree_util.keystr(path)
    assert_close(got, expected, name, tolerance=1e-4 if "['rel']" in name else 1e-5)
  again, _ = split_step()
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(updates)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_resumed_split_run_with_attention_dropout_ends_bit_identical(tmp_path):
  """The persistent masks follow the step's key: a run stopped after its first
  checkpoint and resumed ends with the uninterrupted run's variables, bit for bit. On
  a text8 sample: each start ends by evaluating its whole splits, 2,000 characters
  here against the embedded corpus's 240,000."""
  config = helpers.tiny_run()
  config.data.update(data_fixtures.text8_data(tmp_path))
  config.model.update(dict(attention_impl="split", persistent_impl="xla", dropout_attn=0.2))
  config.train.num_steps = 4
  config.checkpoint.every_steps = 2
  config.eval.every_steps = 0
  workdir = tmp_path / "run"
  helpers.train_run(config, workdir)
  uninterrupted = checkpointing.read_model(workdir)[1]
  shutil.rmtree(workdir / "checkpoints" / "4")    # as if it had died after step 2
  helpers.train_run(config, workdir)
  for a, b in zip(jax.tree.leaves(uninterrupted),
                  jax.tree.leaves(checkpointing.read_model(workdir)[1])):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("rate, closed, closed_scale, tiles", [
    (0.0, None, 1.0, SMALL_TILES), (0.3, "groups", 1.0, SMALL_TILES),
    (0.3, None, 1.0, persistent_pallas.Tiles(rows=8, slots=64, chunks=2)),
    # Closed slots scoring 30 times the open ones: the running max is the open slots'
    # (with theirs, every open exponential would underflow: l = 0, out = 0/0).
    (0.3, "groups", 30.0, SMALL_TILES)],
    ids=["no_dropout", "slot_weights", "wide_tiles", "closed_slots_above_the_rest"])
def test_pallas_part_matches_the_xla_part(rate, closed, closed_scale, tiles, monkeypatch):
  """In Pallas' interpreter, several tiles in every direction (15 query rows in tiles
  of 8, 70 slots in tiles of 32 or 64, 2 chunks); alone and inside the split core;
  finite. 3e-6:
  sums over slot tiles round otherwise (observed 2e-6 at one element of dqp, where
  large terms cancel; there the Pallas and XLA parts are 1.2e-6 and 0.8e-6 from a
  float64 reference)."""
  args, mask, dout = core_inputs(t=5, n=70, dh=12, closed=closed, closed_scale=closed_scale)
  qp, pk, pv, pw = args[2], args[6], args[7], args[8]
  part = persistent_cores.Part("pallas", tiles)
  run = lambda p: jax.jit(functools.partial(persistent_trial.outputs_and_grads, p, rate,
                                            jnp.float32))(qp, pk, pv, pw, *seeds(rate, qp, pk),
                                                          dout)
  for name, got, expected in zip(("out", "lse", "dqp", "dpk", "dpv", "dpw"), run(part),
                                 run(persistent_cores.PARTS["xla"])):
    if expected is None:
      assert got is None
    else:
      assert np.all(np.isfinite(got)), name
      assert_close(got, expected, name, tolerance=3e-6)
  monkeypatch.setattr(core_choice, "persistent_part", lambda *_: part)
  got, expected = run_cores(
      functools.partial(split_core.attend, rate, 2, False, jnp.float32, persistent="pallas"),
      functools.partial(xla_core.attend, rate, 2, False, jnp.float32),
      rate, args, mask, dout)
  assert_all_close(got, expected, tolerance=3e-6)


@pytest.mark.parametrize("tiles", [persistent_pallas.Tiles(rows=16, slots=32, chunks=2),
                                   persistent_pallas.Tiles(rows=16, slots=64, chunks=2),
                                   *gpu_pieces.TILE_CANDIDATES], ids=str)
def test_pallas_part_lowers_for_the_gpu(tiles):
  """The Triton lowering accepts the three kernels (the device check's tiles and
  others) in bf16 with dropout and slot weights, with the tiles' warps and pipeline
  stages, for an abstract GPU (test_perf_gpu_compile.py compiles them)."""
  rate = 0.2
  args = persistent_trial.trial_problem(jnp.bfloat16, rate, True, h=2, b=2, t=24, n=70, dh=12)
  kernels = dict(rate=rate, tiles=tiles, interpret=False)

  def forward_and_backward(qp, pk, pv, pw, rows, columns, dout):
    acc, top, norm = persistent_pallas.forward(qp, pk, pv, pw, rows, columns, **kernels)
    delta = jnp.sum(acc * dout, -1) / norm
    return acc, persistent_pallas.backward(qp, pk, pv, pw, rows, columns, top, norm, delta,
                                           dout, **kernels)

  try:
    lowered = gpu_compile.lowered_for_gpu(forward_and_backward, *args)
  except ModuleNotFoundError as e:   # a jaxlib without the Triton dialect
    pytest.skip(str(e))
  text = lowered.as_text()
  for name, warps in (("forward", tiles.warps), ("query_grads", tiles.warps),
                      ("slot_grads", tiles.slot_warps)):
    # The kernel's custom-call settings, in whatever order the lowering writes them.
    settings = re.search(rf'name = "allatt_persistent_{name}"[^}}]*}}', text).group(0)
    assert f"num_warps = {warps} :" in settings and f"num_stages = {tiles.stages} :" in settings
  assert text.count("__gpu$xla.gpu.triton") == 3


def _stand_in_for_cudnn():
  """jax's cuDNN module with its calls in XLA, their signatures jax's: cuDNN's
  arithmetic (weights exp(s − stats), δ = Σ O·dO from the residuals handed to the
  backward rule), so that the part's arguments and layouts are checked here."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top

  def dot_product_attention(query, key, value, *, scale, qkv_layout, return_residual):
    assert (scale, qkv_layout, return_residual) == (1.0, "BNTH", True)
    s = jnp.einsum("bntd,bnsd->bnts", query, key, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(s, -1)
    p = jnp.exp(s - lse[..., None])
    return jnp.einsum("bnts,bnsd->bntd", p.astype(value.dtype), value), lse

  def backward_rule(**kwargs):
    query, key, value, *_, stats, out = kwargs["res"]
    dout = kwargs["grad_output"]
    # What the forward computed: no mask, bias, dropout or window, the queries come
    # scaled; one batch row of B·T queries per head against its slots (BNTH).
    settings = {name: kwargs[name] for name in (
        "scale", "dropout_rate", "mask_type", "layout", "sliding_window_length",
        "variadic_args")}
    assert settings == dict(scale=1.0, dropout_rate=0.0, mask_type=fa.MaskType.NO_MASK,
                            layout=fa.AttentionLayout.BNTH.value, sliding_window_length=None,
                            variadic_args=(False, False)), settings
    (_, heads, rows, head_dim), slots = query.shape, key.shape[2]
    assert key.shape == value.shape == (1, heads, slots, head_dim)
    assert stats.shape == (1, heads, rows) and stats.dtype == jnp.float32
    assert out.shape == dout.shape == query.shape
    p = jnp.exp(jnp.einsum("bntd,bnsd->bnts", query, key) - stats[..., None])
    ds = p * (jnp.einsum("bntd,bnsd->bnts", dout, value)
              - jnp.sum(out * dout, -1, keepdims=True))
    return (jnp.einsum("bnts,bnsd->bntd", ds, key), jnp.einsum("bnts,bntd->bnsd", ds, query),
            jnp.einsum("bnts,bntd->bnsd", p, dout), None)

  backward_rule.__signature__ = inspect.signature(getattr(fa, "_dot_product_attention_bwd_rule"))
  return types.SimpleNamespace(
      dot_product_attention=dot_product_attention, MaskType=fa.MaskType,
      AttentionLayout=fa.AttentionLayout, _dot_product_attention_bwd_rule=backward_rule,
      _dot_product_attention_fwd_rule=fa._dot_product_attention_fwd_rule,
      check_cudnn_version=lambda: None)


def test_cudnn_part_hands_cudnn_the_merged_statistics(monkeypatch):
  """With a stand-in computing what cuDNN computes, the cuDNN part inside the split
  core is the XLA core: its residuals (the merged lse and output) are built right."""
  assert not persistent_cudnn._unknown_parameters(persistent_cudnn._module())
  monkeypatch.setattr(persistent_cudnn, "_module", _stand_in_for_cudnn)
  monkeypatch.setattr(persistent_cudnn, "why_not_here", lambda dtype, head_dim: None)
  args, mask, dout = core_inputs()
  got, expected = run_cores(
      functools.partial(split_core.attend, 0.0, 2, False, jnp.float32, persistent="cudnn"),
      functools.partial(xla_core.attend, 0.0, 2, False, jnp.float32),
      0.0, args, mask, dout)
  assert_all_close(got, expected, tolerance=2e-6)


def test_cudnn_part_refuses_head_dims_cudnn_cannot_take(monkeypatch):
  """On a GPU with cuDNN (pretended), heads of 8 to 256 in steps of 8 run; any other
  size is refused in one line, so the model falls back to the XLA part (and a config
  asking for cuDNN is refused) instead of failing while it traces."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(persistent_cudnn, "_module", _stand_in_for_cudnn)
  for head_dim in (8, 64, 256):
    assert persistent_cudnn.why_not_here(jnp.bfloat16, head_dim) is None
  for head_dim in (12, 264, 4):
    why_not = persistent_cudnn.why_not_here(jnp.bfloat16, head_dim)
    assert why_not == (f"cuDNN's attention takes head dimensions up to 256 in multiples "
                       f"of 8 and this model's heads have {head_dim}")
  assert core_choice.persistent_part("cudnn", 0.0, False, jnp.bfloat16, 12).name == "xla"
  assert core_choice.persistent_part("cudnn", 0.0, False, jnp.bfloat16, 16).name == "cudnn"


def test_a_jaxlib_without_triton_imports_the_model_and_says_why_pallas_cannot_run():
  """Pallas' Triton backend missing (as from a jaxlib built without it): the model
  still imports and runs, and 'pallas' is refused with the reason, in one line."""
  script = """
import sys
sys.modules["jax.experimental.pallas.triton"] = None   # its import now fails
from allatt_jax.model import transformer
from allatt_jax.model.attention import core_choice
from allatt_jax.model.attention import persistent_cores
from allatt_jax.config.errors import ConfigError
print(persistent_cores.why_not_here("pallas", "float32", 64))
try:
  core_choice.check_persistent_impl("split", "pallas", 0.0, "float32", False, 64)
except ConfigError as e:
  print(e)
"""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  reason, error = result.stdout.strip().splitlines()[-2:]
  assert reason.startswith("this jaxlib lacks Pallas' Triton backend (ModuleNotFoundError: ")
  assert error.startswith("config.model.persistent_impl='pallas' asks for the persistent "
                          f"part's pallas implementation, but {reason}.")


def test_choices_and_refusals(monkeypatch):
  # On a CPU: 'auto' is the XLA core (the CPU demo computes what it computed), and
  # the split core's 'auto' persistent part is XLA's.
  assert not core_choice.use_split("auto", 0.0) and core_choice.use_split("split", 0.2)
  assert core_choice.persistent_part("auto", 0.3, True, jnp.float32, 8).name == "xla"
  # Asked for where they cannot run (a model read from disk): the XLA part.
  for impl in ("pallas", "cudnn"):
    assert core_choice.persistent_part(impl, 0.0, False, jnp.bfloat16, 8).name == "xla"
  with pytest.raises(ConfigError, match=r"^config\.model\.persistent_impl='cudnn': cuDNN's "
                     r"attention dropout cannot follow the step's key.*\(attention dropout "
                     r"here: 0\.2\)\. Use --config\.model\.persistent_impl=auto"):
    core_choice.persistent_part("cudnn", 0.2, False, jnp.bfloat16, 8)
  with pytest.raises(ConfigError, match="cannot weight persistent slots"):
    core_choice.persistent_part("cudnn", 0.0, True, jnp.bfloat16, 8)
  with pytest.raises(ConfigError, match=r"persistent_impl='flash' is unknown"):
    core_choice.persistent_part("flash", 0.0, False, jnp.float32, 8)

  config = config_base.base_config()
  config.model.update(dict(vocab_size=11, num_persistent=8, attention_impl="split"))
  check = lambda: config_checks.check_config(run_config.RunConfig.of(config), 1)
  check()   # split with the 'auto' part runs anywhere
  for impl, message in (("cudnn", "needs a GPU with cuDNN and this process runs on cpu"),
                        ("pallas", "need a CUDA GPU")):
    config.model.persistent_impl = impl
    config.model.dropout_attn = 0.0
    with pytest.raises(ConfigError, match=f"persistent_impl='{impl}'.*{message}") as error:
      check()
    assert "\n" not in str(error.value)
  # Training with attention dropout: refused whatever the device.
  config.model.persistent_impl, config.model.dropout_attn = "cudnn", 0.2
  monkeypatch.setattr(persistent_cudnn, "why_not_here", lambda dtype, head_dim: None)
  with pytest.raises(ConfigError, match="dropout cannot follow the step's key"):
    check()
  # 'auto' runs the split core only where a layer has no dropout: evaluation, here.
  config.model.attention_impl = "auto"
  check()
  config.model.attention_impl, config.model.dropout_attn = "split", 0.0
  check()
  config.model.persistent_impl = "flash"
  with pytest.raises(ConfigError, match=r"persistent_impl='flash' is unknown"):
    check()
  # A config.json saved before the key existed reads 'auto'.
  saved = run_config.RunConfig.of(config_base.base_config()).to_dict()
  del saved["model"]["persistent_impl"]
  assert run_config.RunConfig.from_dict(saved).model.persistent_impl == "auto"


def test_auto_picks_the_fastest_part_that_passes_its_trial(monkeypatch):
  """On a GPU (pretended: the trials' times and failures are given; their processes:
  test_model_persistent_trial.py), 'auto' is the split core without attention dropout
  and the XLA core with it (as measured on an H200); the split core's 'auto' part is
  the fastest whose trial passes in time."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(persistent_cudnn, "why_not_here", lambda dtype, head_dim: None)

  def seconds(name, rate, weighted, dtype, limit):
    del rate
    assert limit == core_choice.TRIAL_SECONDS
    if name == "pallas" and weighted:   # a stalled compile, its process ended
      raise TimeoutError(f"not done within {limit:g} s; its process was ended")
    if name == "pallas" and dtype == "float16":
      raise RuntimeError("it disagrees with the XLA part")
    return {"xla": 3e-3, "pallas": 2e-3, "cudnn": 1e-3}[name]

  monkeypatch.setattr(persistent_trial, "seconds", seconds)
  core_choice._auto.cache_clear()
  try:
    assert core_choice.use_split("auto", 0.0) and not core_choice.use_split("auto", 0.2)
    choose = lambda rate, weighted, dtype=jnp.bfloat16: core_choice.persistent_part(
        "auto", rate, weighted, dtype, 64).name
    assert choose(0.0, False) == "cudnn"
    assert choose(0.2, False) == "pallas"   # cuDNN's dropout would not follow the key
    assert choose(0.2, True) == "xla"       # Pallas stalled, cuDNN cannot weight slots
    assert choose(0.2, False, jnp.float16) == "xla"   # Pallas disagreed
  finally:
    core_choice._auto.cache_clear()


def test_a_trial_refuses_a_part_that_disagrees_with_the_xla_part(monkeypatch):
  """A part whose results are not the XLA part's is never timed, so 'auto' cannot
  choose it for being fast."""
  class Inflated(persistent_cores.Part):
    def forward(self, *args):
      acc, top, norm = super().forward(*args)
      return acc * 1.5, top, norm

  monkeypatch.setitem(persistent_cores.PARTS, "pallas", Inflated("xla"))
  with pytest.raises(RuntimeError,
                     match=r"^it disagrees with the XLA part \(out: max difference "):
    persistent_trial.trial("pallas", 0.0, False, "float32", steps=1)
  assert persistent_trial.trial("xla", 0.0, False, "float32", steps=1) > 0


_SHARDED = """
import functools, json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
sys.path.insert(0, sys.argv[1])
import test_model_split_core as t
from allatt_jax.model.attention import xla_core
from allatt_jax.model.attention import core_choice
from allatt_jax.model.attention import persistent_cores
from allatt_jax.parallel import sharding
from allatt_jax.model.attention import split_core
mesh = sharding.make_mesh((2, 2))
args, mask, dout = t.core_inputs(h=4, b=4, n=70, closed="groups")
expected = jax.jit(functools.partial(t.outputs_and_grads, functools.partial(
    xla_core.attend, 0.3, 4, False, jnp.float32), 0.3))(args, mask, dout)
differences = {}
with jax.set_mesh(mesh):
  place = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  args = ([place(x, P("model", "data")) for x in args[:5]]
          + [place(x, P("model")) for x in args[5:]])
  for name in ("xla", "pallas"):
    core = functools.partial(split_core.attend, 0.3, 4, False, jnp.float32, persistent=name)
    if name == "pallas":
      part = persistent_cores.Part("pallas", t.SMALL_TILES)
      core_choice.persistent_part = lambda *a: part
    got = jax.jit(functools.partial(t.outputs_and_grads, core, 0.3))(args, mask, dout)
    differences[name] = max(float(jnp.abs(a - b).max() / jnp.abs(b).max())
                            for a, b in zip(got, expected))
print(json.dumps(differences))
"""


@pytest.mark.slow
def test_split_core_on_a_2x2_mesh():
  """Heads over 'model', batch rows over 'data': the XLA part through XLA's
  partitioner, the Pallas part per shard (its slot gradients summed over 'data'); the
  unsharded XLA core's values and gradients, the same dropout masks."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": helpers.xla_flags(cpu_devices=4)}
  result = subprocess.run([sys.executable, "-c", _SHARDED, str(REPO / "tests")], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  differences = json.loads(result.stdout.strip().splitlines()[-1])
  assert max(differences.values()) < 2e-6, differences
