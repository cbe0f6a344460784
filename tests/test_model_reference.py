"""The model against an independent, deliberately naive NumPy reference.

The reference below shares no code with allatt_jax: it loops over layers, heads,
queries and keys, and writes every formula out as the papers give it (Transformer-XL's
relative attention with memory, Dai et al. 2019; All-attention's persistent vectors,
Sukhbaatar et al. 2019; the hard-concrete gates and output scaling of Shim et al. 2021)
with the recipe choices of the code behind the paper's numbers as options. Only the
token embedding is taken from the model: the reference starts at the first layer.
"""
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from allatt_jax.model import transformer as model_lib
from allatt_jax.config import run_config

VOCAB, D, H, N, D_FF = 29, 16, 4, 5, 24
T, S = 4, 6          # segments shorter than the memory: it fills partly, then fully


def layer_norm(x, scale, bias, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * scale + bias


def softmax(scores):
  e = np.exp(scores - scores.max())
  return e / e.sum()


def relative_position(cfg, table, distance):
  """The relative position vector for a key `distance` positions before the query."""
  if cfg.rel_pos == "learned":
    return table[distance]
  inv_freq = 1.0 / 10000 ** (np.arange(0, D, 2) / D)
  return np.concatenate([np.sin(distance * inv_freq), np.cos(distance * inv_freq)])


def gate_values(cfg, logits):
  if cfg.gate.hard:
    return np.array([1.0 if (p >= 0 if cfg.gate.open_at_zero else p > 0) else 0.0
                     for p in logits])
  sig = 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))
  return np.clip(sig * 1.2 - 0.1, 0.0, 1.0)


def visible(cfg, i, j, valid):
  """May query i of the segment (key position S + i) see key j (of S + T)?"""
  if j > S + i or j < S - valid:
    return False
  if cfg.same_length:
    first = i if cfg.same_length_keys == "mem_len+1" else i + 1
    return j >= first
  return True


def attention_layer(cfg, p, table, gates, x, mem, valid):
  """One attention sub-layer's output for one sequence: x (T, D), mem (S, D)."""
  eps = cfg.layer_norm_eps
  xn = layer_norm(x, p["attention_norm"]["scale"], p["attention_norm"]["bias"], eps)
  mn = layer_norm(mem, p["attention_norm"]["scale"], p["attention_norm"]["bias"], eps)
  kv = np.concatenate([mn, xn])
  a = p["attention"]
  dh = D // H
  g = gate_values(cfg, gates) if gates is not None else np.ones(H)
  scale_g = H / max(g.sum(), 1.0) if (gates is not None and cfg.gate.scale_output) else 1.0
  out = np.zeros((T, D))
  for h in range(H):
    wq, wk, wv, wr = (a[n]["kernel"][:, h, :] for n in ("query", "key", "value", "rel"))
    u, v = a["content_bias"][h], a["position_bias"][h]
    for i in range(T):
      q = xn[i] @ wq
      scores, values = [], []
      for j in range(S + T):
        if not visible(cfg, i, j, valid):
          continue
        r = relative_position(cfg, table, S + i - j) @ wr
        scores.append(((q + u) @ (kv[j] @ wk) + (q + v) @ r) / math.sqrt(dh))
        values.append(kv[j] @ wv)
      if cfg.kind == "allatt":
        for n in range(N):
          pk = a["persistent_key"][h, n] * math.sqrt(dh)
          pv = a["persistent_value"][h, n] * math.sqrt(N)
          query = q + u if cfg.persistent_content_bias else q
          scores.append(query @ pk / math.sqrt(dh))
          values.append(pv)
      head_out = softmax(np.array(scores)) @ np.array(values)
      out[i] += g[h] * scale_g * (head_out @ a["out"]["kernel"][h])
  if cfg.out_bias:
    out += a["out"]["bias"]
  return out


def reference_hidden(cfg, params, gates, x_BxTxD, memory):
  """Final hidden states and the next memory, one sequence at a time."""
  hidden = np.zeros_like(x_BxTxD)
  mem_LxBxSxD, valid = memory["hidden"], int(memory["length"])
  entering = np.zeros((cfg.num_layers, *x_BxTxD.shape))
  for b in range(x_BxTxD.shape[0]):
    x = x_BxTxD[b]
    for layer in range(cfg.num_layers):
      p = params[f"layer_{layer}"]
      entering[layer, b] = x
      layer_gates = gates[f"layer_{layer}"]["attention"]["logits"] if gates else None
      x = x + attention_layer(cfg, p, params.get("relative_table"), layer_gates, x,
                              mem_LxBxSxD[layer, b], valid)
      if cfg.kind == "txl":
        n = p["feed_forward_norm"]
        h = layer_norm(x, n["scale"], n["bias"], cfg.layer_norm_eps)
        f = p["feed_forward"]
        h = np.maximum(h @ f["wi"]["kernel"] + f["wi"]["bias"], 0.0)
        x = x + h @ f["wo"]["kernel"] + f["wo"]["bias"]
    if cfg.final_norm:
      x = layer_norm(x, params["final_norm"]["scale"], params["final_norm"]["bias"],
                     cfg.layer_norm_eps)
    hidden[b] = x
  new_hidden = np.concatenate([mem_LxBxSxD, entering], axis=2)[:, :, -S:]
  return hidden, new_hidden, min(valid + T, S)


def perturbed_model(cfg, gate_logits):
  """The model's variables with every parameter moved well away from its init."""
  lm = model_lib.TransformerLM(cfg)
  x = jnp.zeros((2, T), jnp.int32)
  variables = nn.unbox(lm.init(jax.random.key(0), x, x, model_lib.init_memory(cfg, 2, S)))
  leaves, treedef = jax.tree.flatten(variables["params"])
  keys = jax.random.split(jax.random.key(1), len(leaves))
  params = treedef.unflatten([leaf + 0.3 * jax.random.normal(k, leaf.shape)
                              for leaf, k in zip(leaves, keys)])
  variables = {"params": params}
  if cfg.gated:
    variables["gates"] = {f"layer_{i}": {"attention": {"logits": jnp.array(gate_logits[i])}}
                          for i in range(cfg.num_layers)}
  return lm, variables


# Layer 0 has an open, a closed and a logit-0 head (open iff open_at_zero); layer 1
# keeps one head, so s_g = 4 there.
GATE_LOGITS = ((1.5, -0.7, 0.0, 2.5), (-3.0, 0.4, -1.0, -2.0))
HARD = run_config.GatesSection(hard=True)
CASES = {
    "allatt": dict(),
    "allatt_txl_window": dict(same_length_keys="mem_len"),
    "allatt_no_same_length": dict(same_length=False),
    "allatt_sinusoidal": dict(rel_pos="sinusoidal"),
    "allatt_persistent_content_bias": dict(persistent_content_bias=True),
    "allatt_final_norm_no_out_bias_flax_eps": dict(final_norm=True, out_bias=False,
                                                   layer_norm_eps=1e-6),
    "allatt_hard_gates": dict(gated=True, gate=HARD),
    "allatt_hard_gates_closed_at_zero": dict(
        gated=True, gate=run_config.GatesSection(open_at_zero=False)),
    "allatt_hard_gates_unscaled": dict(
        gated=True, gate=run_config.GatesSection(scale_output=False)),
    "allatt_soft_gates": dict(gated=True, gate=run_config.GatesSection(hard=False)),
    "txl": dict(kind="txl"),
    "txl_sinusoidal_hard_gates": dict(kind="txl", rel_pos="sinusoidal", gated=True,
                                      gate=HARD),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_model_equals_naive_reference(case):
  overrides = CASES[case]
  kind = overrides.get("kind", "allatt")
  cfg = model_lib.ModelConfig(
      vocab_size=VOCAB, num_layers=2, d_model=D, num_heads=H,
      num_persistent=N if kind == "allatt" else 0, d_ff=D_FF if kind == "txl" else 0,
      max_relative_len=S + T, **overrides)
  lm, variables = perturbed_model(cfg, GATE_LOGITS)
  params = jax.tree.map(lambda x: np.asarray(x, np.float64), variables["params"])
  gates = jax.tree.map(np.asarray, variables.get("gates"))

  tokens = jax.random.randint(jax.random.key(2), (2, 3 * T), 0, VOCAB)
  memory = model_lib.init_memory(cfg, 2, S)
  ref_memory = {"hidden": np.zeros((2, 2, S, D)), "length": 0}
  for start in range(0, 3 * T, T):     # empty, partial (T of S), then full memory
    x = tokens[:, start:start + T]
    hidden, memory, _ = lm.apply(variables, x, memory, method=lm.hidden)
    x_BxTxD = lm.apply(variables, x, method=lambda m, t: m.embedding.embed(t))
    ref_hidden, ref_memory_hidden, ref_length = reference_hidden(
        cfg, params, gates, np.asarray(x_BxTxD, np.float64), ref_memory)
    np.testing.assert_allclose(hidden, ref_hidden, rtol=1e-5, atol=1e-5,
                               err_msg=f"segment at {start}")
    np.testing.assert_allclose(memory["hidden"], ref_memory_hidden, rtol=1e-5, atol=1e-5)
    assert int(memory["length"]) == ref_length
    # Carry the model's own memory on, so each segment compares one step.
    ref_memory = {"hidden": np.asarray(memory["hidden"], np.float64),
                  "length": int(memory["length"])}


@pytest.mark.slow
def test_reference_tells_the_recipe_choices_apart():
  """Each official choice moves the output: the comparison above would catch a mix-up."""
  base = model_lib.ModelConfig(vocab_size=VOCAB, num_layers=2, d_model=D, num_heads=H,
                               num_persistent=N, max_relative_len=S + T, gated=True)
  lm, variables = perturbed_model(base, GATE_LOGITS)
  params = jax.tree.map(lambda x: np.asarray(x, np.float64), variables["params"])
  gates = jax.tree.map(np.asarray, variables["gates"])
  tokens = jax.random.randint(jax.random.key(3), (2, T), 0, VOCAB)
  x_BxTxD = np.asarray(lm.apply(variables, tokens, method=lambda m, t: m.embedding.embed(t)),
                       np.float64)
  memory = {"hidden": np.asarray(jax.random.normal(jax.random.key(4), (2, 2, S, D))),
            "length": S}
  official, _, _ = reference_hidden(base, params, gates, x_BxTxD, memory)
  for change in (dict(persistent_content_bias=True), dict(same_length_keys="mem_len"),
                 dict(same_length=False), dict(gate=run_config.GatesSection(open_at_zero=False)),
                 dict(out_bias=False)):
    other, _, _ = reference_hidden(dataclasses.replace(base, **change), params, gates,
                                   x_BxTxD, memory)
    assert np.abs(other - official).max() > 1e-3, change
