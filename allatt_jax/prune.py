"""Head removal: the one head surgery, a model's variables to a smaller model's params.

`remove_heads` removes the given heads (indices or a mask) and a gated model's closed
ones: each loses its slices of every attention parameter, and the survivors' W_O slices
absorb g_i · s_g (gate value times the layer's output scale over its full gate vector),
the factor the gated model applies. The result is a plain `TransformerLM` whose outputs
equal the gated model's deterministic ones, hard or soft. A headless layer keeps only
W_O's bias (`model.HEADLESS_OUT_BIAS`) and, in TXL, its feed-forward.
"""
from collections.abc import Iterable, Mapping, Sequence
import dataclasses

import flax.linen as nn
from flax import traverse_util
import jax.numpy as jnp
import numpy as np

from allatt_jax import errors
from allatt_jax import gates as gates_lib
from allatt_jax import model as model_lib
from allatt_jax import persistent_groups
from allatt_jax import run_config

# Where the head axis sits in each attention parameter, keyed by its path under
# `layer_{i}/attention`: kernels (d, H, dh) / (H, dh, d), biases (H, dh),
# persistent vectors (H, N, dh).
_HEAD_AXIS = {
    ("query", "kernel"): 1,
    ("key", "kernel"): 1,
    ("value", "kernel"): 1,
    ("rel", "kernel"): 1,
    ("content_bias",): 0,
    ("position_bias",): 0,
    ("persistent_key",): 0,
    ("persistent_value",): 0,
    ("out", "kernel"): 0,
}
_OUT_KERNEL = ("out", "kernel")
_PERSISTENT = (("persistent_key",), ("persistent_value",))
_OUT_BIAS = ("out", "bias")
# Sub-modules of a layer that exist only while it has heads.
_ATTENTION_MODULES = ("attention", "attention_norm")
_CERTAIN_LOGIT = persistent_groups.CERTAIN_LOGIT


def _gate_logits(cfg: model_lib.ModelConfig, gates) -> list[np.ndarray]:
  """Per layer, a float32 copy of the gate logits (H_i,); empty for a headless layer;
  open for certain where the heads have no gates (`gates.heads=False`)."""
  logits = []
  for i, heads in enumerate(cfg.layer_heads):
    if not heads:
      logits.append(np.zeros((0,), np.float32))
      continue
    if not cfg.gate.heads:
      logits.append(np.full((heads,), _CERTAIN_LOGIT, np.float32))
      continue
    try:
      logits_H = np.array(gates[f"layer_{i}"]["attention"]["logits"], np.float32)
    except KeyError:
      raise errors.CheckpointError(
          f"The gates collection has no logits for layer_{i} (expected at "
          f"gates/layer_{i}/attention/logits); the variables do not come from a gated "
          "model of this config.") from None
    if logits_H.shape != (heads,):
      raise errors.CheckpointError(
          f"Gate logits of layer_{i} have shape {logits_H.shape}, but the config gives "
          f"that layer {heads} heads; the variables do not match the config.")
    logits.append(logits_H)
  return logits


def _deterministic(logits: list[np.ndarray], gate: run_config.GatesSection) -> list[np.ndarray]:
  """Per layer, the deterministic gate values of `logits`."""
  return [np.asarray(gates_lib.deterministic(jnp.asarray(logits_H), gate))
          if logits_H.size else logits_H for logits_H in logits]


def _gate_values(cfg: model_lib.ModelConfig, gates) -> list[np.ndarray]:
  """Per layer, the deterministic gate values (H_i,); empty for a headless layer."""
  logits = _gate_logits(cfg, gates)
  return _deterministic(logits, cfg.gate)


def surviving_heads(cfg: model_lib.ModelConfig, gates) -> tuple[np.ndarray, ...]:
  """Per layer, the indices of the heads whose deterministic gate is open (> 0).

  Args:
    cfg: the gated model's config.
    gates: its `gates` collection ({'layer_i': {'attention': {'logits': (H_i,)}}}).

  Returns:
    One int array per layer, ascending; empty for a fully closed or headless layer.
  """
  return tuple(np.flatnonzero(g_H > 0) for g_H in _gate_values(cfg, gates))

def keep_open_heads(cfg: model_lib.ModelConfig, gates,
                    num_open: int) -> tuple[dict, dict]:
  """The gates with exactly `num_open` heads open by the deterministic rule.

  A budget allows n* heads; the gates, frozen wherever training left them, may keep
  more or fewer. The heads are then ranked by their logit, over all layers, and the
  top `num_open` are the survivors; among equal logits the lower layer, then the lower
  head index, ranks first. A survivor the deterministic rule closed gets a logit that
  opens it for certain, a head outside the top that the rule kept one that closes it
  for certain; every other logit is left as it is. Where the rule already keeps
  `num_open` heads nothing changes, so applying this twice changes nothing more.

  Args:
    cfg: the gated model's config.
    gates: its `gates` collection ({'layer_i': {'attention': {'logits': (H_i,)}}}).
    num_open: n*, 0 .. the model's head count.

  Returns:
    (the new gates collection as numpy arrays, the decision: 'allowed', 'by_gates'
    (the heads the deterministic rule kept), 'changed' (head decisions the budget
    reversed) and the reversed heads as [layer, head] pairs in 'opened' and 'closed').
  """
  values = _gate_values(cfg, gates)
  logits = {i: np.array(gates[f"layer_{i}"]["attention"]["logits"], np.float32)
            for i, heads in enumerate(cfg.layer_heads) if heads}
  heads = [(i, h) for i in logits for h in range(len(logits[i]))]
  if not 0 <= num_open <= len(heads):
    raise errors.ConfigError(f"A budget of {num_open} open heads does not fit a model "
                             f"of {len(heads)} heads.")
  ranked = sorted(heads, key=lambda ih: (-logits[ih[0]][ih[1]], ih[0], ih[1]))
  survivors = set(ranked[:num_open])
  opened = [ih for ih in heads if ih in survivors and values[ih[0]][ih[1]] <= 0]
  closed = [ih for ih in heads if ih not in survivors and values[ih[0]][ih[1]] > 0]
  for i, h in opened:
    logits[i][h] = _CERTAIN_LOGIT
  for i, h in closed:
    logits[i][h] = -_CERTAIN_LOGIT
  new_gates = {f"layer_{i}": {"attention": {"logits": logits_H}}
               for i, logits_H in logits.items()}
  decision = {"allowed": num_open, "by_gates": num_open - len(opened) + len(closed),
              "changed": len(opened) + len(closed),
              "opened": [list(ih) for ih in opened], "closed": [list(ih) for ih in closed]}
  return new_gates, decision


def decision_line(decision: dict, num_heads: int) -> str:
  """`keep_open_heads`' decision on a model of `num_heads` heads, in a line."""
  line = (f"budget: the gates keep {decision['by_gates']} of {num_heads} heads at the "
          f"freeze, the budget allows {decision['allowed']}")
  if not decision["changed"]:
    return line + ": kept as they are"
  return line + (f": {decision['changed']} head decision(s) changed by logit rank "
                 f"(opened {len(decision['opened'])}, closed {len(decision['closed'])})")


def running_model_config(cfg: model_lib.ModelConfig, variables) -> model_lib.ModelConfig:
  """`cfg`, or for a gated model the ungated one of its open heads and persistent
  groups (its export's)."""
  if not cfg.gated:
    return cfg
  keep, slots = _kept_units(cfg, variables["gates"], _gate_values(cfg, variables["gates"]))
  return _pruned_config(cfg, keep, slots)


def remove_heads(cfg: model_lib.ModelConfig, variables,
                 heads: Mapping[int, Iterable[int]] | Sequence[np.ndarray] | None = None,
                 slots: Mapping[int, Mapping[int, Iterable[int]]] | None = None
                 ) -> tuple[model_lib.ModelConfig, dict]:
  """The smaller, ungated model without the chosen heads: the one head surgery.

  A gated model (a pruning run) also loses the heads its deterministic gates close,
  and its gates fold into the survivors' W_O slices, so the result computes its
  deterministic outputs: that is its export. An ungated model keeps its other heads
  unchanged (hard gates, no output scale). Persistent slots go with their head, and
  a head also loses the slots of its closed persistent groups (`persistent_groups`)
  and those `slots` names; a closed group takes no attention mass, so removing it
  changes no output. Where the heads of a layer then keep different numbers of slots,
  they are ordered by that number (most first) and each layer's arrays hold the
  largest (`model.ModelConfig.persistent_slots`; attention.py computes each head with
  its own slots only).

  Args:
    cfg: the model's config, gated or not.
    variables: its variables ({'params'}, and {'gates'} when gated), unboxed arrays.
    heads: the heads to remove, as {layer: [head, ...]} (indices of the layer's
      current heads, 0 .. H_layer - 1) or as a mask (one bool array (H_layer,) per
      layer, True = keep); None removes none.
    slots: persistent slots to remove, {layer: {head: [slot, ...]}} (indices of the
      layer's current heads and of each head's current slots); None removes none.

  Returns:
    The smaller model's config (heads_per_layer = the heads left per layer,
    persistent_slots = their slots where not all N, gated=False, the rest as in
    `cfg`) and its params tree, as numpy arrays.

  Raises:
    CheckpointError: a gated model's variables have no gates, or do not fit `cfg`.
    ConfigError: a layer, head or slot index out of range, or a mask of another shape
      (the message names it).
  """
  removed = _removed_heads(cfg, heads)
  removed_slots = _checked_slots(cfg, slots)
  if cfg.gated:
    if not variables.get("gates"):
      raise errors.CheckpointError(
          "The variables have no 'gates' collection: this run has no head gates, so "
          "there is nothing to prune. Export needs a pruning run (gates.enabled=True), "
          "not a baseline.")
    logits, gate = _gate_logits(cfg, variables["gates"]), cfg.gate
  else:
    logits = [np.full((num_heads,), _CERTAIN_LOGIT, np.float32)
              for num_heads in cfg.layer_heads]
    gate = run_config.GatesSection(hard=True, scale_output=False)
  for layer, layer_heads in removed.items():
    logits[layer][layer_heads] = -_CERTAIN_LOGIT
  values = _deterministic(logits, gate)
  keep, kept_slots = _kept_units(cfg, variables.get("gates") if cfg.gated else None,
                                 values, removed_slots)
  return _cut_heads(cfg, variables["params"], values, gate, keep, kept_slots)


def _kept_units(cfg: model_lib.ModelConfig, gates, values: list[np.ndarray],
                removed_slots: Mapping[int, Mapping[int, list[int]]] | None = None
                ) -> tuple[list[np.ndarray], list[list[np.ndarray]] | None]:
  """(per layer, the heads kept in their order in the smaller model; per layer and
  kept head, its persistent slots kept, or None where every kept head keeps all N)."""
  gated_slots = persistent_groups.kept_slots(cfg, gates) if gates is not None else None
  keep, slots = [], []
  for i, g_H in enumerate(values):
    heads = np.flatnonzero(g_H > 0)
    current = cfg.head_slots(i)
    head_slots = []
    for h in heads:
      kept_h = np.arange(current[h])
      if gated_slots is not None and gated_slots[i] is not None:
        kept_h = gated_slots[i][h]
      gone = (removed_slots or {}).get(i, {}).get(int(h), ())
      head_slots.append(np.setdiff1d(kept_h, gone))
    # Most slots first (stably), so that heads of equal counts sit together.
    order = sorted(range(len(heads)), key=lambda j: -len(head_slots[j]))
    keep.append(heads[order])
    slots.append([head_slots[j] for j in order])
  full = cfg.kind == "allatt" and cfg.num_persistent
  if cfg.persistent_slots is None and all(
      len(s) == full for layer in slots for s in layer):
    return [np.flatnonzero(g_H > 0) for g_H in values], None
  return keep, slots


def _pruned_config(cfg: model_lib.ModelConfig, keep, slots) -> model_lib.ModelConfig:
  """The config of the model keeping heads `keep` with `slots` (`_kept_units`)."""
  return dataclasses.replace(
      cfg, heads_per_layer=tuple(len(k) for k in keep), gated=False,
      persistent_slots=None if slots is None else tuple(
          tuple(len(s) for s in layer) for layer in slots))


def _cut_heads(cfg: model_lib.ModelConfig, params, values: list[np.ndarray],
               gate: run_config.GatesSection, keep, slots) -> tuple[model_lib.ModelConfig, dict]:
  """Slices out the heads `keep` leaves out and the slots `slots` does (padding each
  layer's persistent arrays to its largest count), and folds g_i · s_g into W_O."""
  combine = []
  for g_H in values:
    # The scale uses the layer's full gate vector, as the gated forward pass does.
    combine_H = g_H * np.asarray(gates_lib.output_scale(jnp.asarray(g_H), gate))
    combine.append(combine_H.astype(np.float32))

  pruned_cfg = _pruned_config(cfg, keep, slots)
  layer_index = {f"layer_{i}": i for i in range(cfg.num_layers)}
  pruned = {}
  for path, leaf in traverse_util.flatten_dict(params).items():
    i = layer_index.get(path[0])
    if i is None or path[1] not in _ATTENTION_MODULES:
      pruned[path] = np.asarray(leaf)
      continue
    sub_path = path[2:]
    if not keep[i].size:
      if sub_path == _OUT_BIAS:
        pruned[(path[0], model_lib.HEADLESS_OUT_BIAS)] = np.asarray(leaf)
      continue
    if path[1] == "attention_norm" or sub_path == _OUT_BIAS:
      pruned[path] = np.asarray(leaf)
      continue
    if sub_path not in _HEAD_AXIS:
      raise errors.CheckpointError(
          f"Unknown attention parameter {'/'.join(path)}: export does not know its "
          "head axis, so it cannot remove heads from it.")
    sliced = np.take(np.asarray(leaf, np.float32), keep[i], axis=_HEAD_AXIS[sub_path])
    if sub_path == _OUT_KERNEL:
      sliced = sliced * combine[i][keep[i]][:, None, None]
    if sub_path in _PERSISTENT and slots is not None:
      if not max(map(len, slots[i])):
        continue   # no head of the layer keeps a slot: the layer has no such arrays
      sliced = _gathered_slots(sliced, slots[i])
    pruned[path] = sliced
  pruned_params = traverse_util.unflatten_dict(pruned)
  _check_matches_init(pruned_cfg, pruned_params)
  return pruned_cfg, pruned_params


def _gathered_slots(vectors_HxNxD: np.ndarray, slots: list[np.ndarray]) -> np.ndarray:
  """Each head's kept slots first, in order, then zeros up to the layer's largest
  count (padding the smaller model never reads)."""
  width = max(map(len, slots))
  out = np.zeros((len(slots), width, vectors_HxNxD.shape[-1]), vectors_HxNxD.dtype)
  for h, kept in enumerate(slots):
    out[h, :len(kept)] = vectors_HxNxD[h, kept]
  return out


def _removed_heads(cfg: model_lib.ModelConfig, heads) -> dict[int, list[int]]:
  """{layer: sorted head indices} of `heads` given as {layer: heads} or as a mask."""
  if heads is None:
    return {}
  if isinstance(heads, Mapping):
    return _checked_heads(cfg, heads)
  mask = [np.asarray(keep) for keep in heads]
  if ([(keep.dtype, keep.shape) for keep in mask]
      != [(np.dtype(bool), (count,)) for count in cfg.layer_heads]):
    got = ", ".join(f"{keep.dtype} {keep.shape}" for keep in mask)
    raise errors.ConfigError(
        f"A head mask needs one bool array per layer, of the layer's head count "
        f"{list(cfg.layer_heads)}; got [{got}].")
  return {i: np.flatnonzero(~keep).tolist() for i, keep in enumerate(mask)}


def _checked_slots(cfg: model_lib.ModelConfig, slots) -> dict[int, dict[int, list[int]]]:
  """{layer: {head: sorted slot indices}} of `slots`, each one that exists."""
  checked = {}
  for layer, by_head in (slots or {}).items():
    heads = _checked_heads(cfg, {layer: list(by_head)})
    checked[int(layer)] = {}
    for head in heads.get(int(layer), []):
      count = cfg.head_slots(int(layer))[head]
      chosen = list(by_head[head])
      bad = [n for n in chosen if not isinstance(n, (int, np.integer)) or not 0 <= n < count]
      if bad:
        raise errors.ConfigError(
            f"Head {head} of layer {layer} has no persistent slot(s) {bad}: its slots "
            f"are 0 .. {count - 1}.")
      checked[int(layer)][head] = sorted(set(int(n) for n in chosen))
  return checked


def _checked_heads(cfg: model_lib.ModelConfig,
                   heads: Mapping[int, Iterable[int]]) -> dict[int, list[int]]:
  checked = {}
  for layer, layer_heads in heads.items():
    if not isinstance(layer, (int, np.integer)) or not 0 <= layer < cfg.num_layers:
      raise errors.ConfigError(
          f"Layer {layer!r} does not exist: the model has layers 0 .. "
          f"{cfg.num_layers - 1}. Give heads as {{layer: [head, ...]}}.")
    layer_heads = list(layer_heads)
    count = cfg.layer_heads[layer]
    bad = [h for h in layer_heads
           if not isinstance(h, (int, np.integer)) or not 0 <= h < count]
    if bad:
      has = f"its heads are 0 .. {count - 1}" if count else "it has no heads left"
      raise errors.ConfigError(f"Layer {layer} has no head(s) {bad}: {has} (heads per "
                               f"layer: {list(cfg.layer_heads)}).")
    checked[int(layer)] = sorted(set(int(h) for h in layer_heads))
  return checked


def _check_matches_init(cfg: model_lib.ModelConfig, params) -> None:
  """Raises unless `params` has the paths and shapes `TransformerLM(cfg).init` makes."""
  abstract = model_lib.abstract_variables(cfg)
  expected = {"/".join(p): x.shape for p, x in
              traverse_util.flatten_dict(nn.unbox(abstract["params"])).items()}
  got = {"/".join(p): x.shape for p, x in traverse_util.flatten_dict(params).items()}
  problems = [f"missing {p} {expected[p]}" for p in sorted(expected.keys() - got.keys())]
  problems += [f"unexpected {p} {got[p]}" for p in sorted(got.keys() - expected.keys())]
  problems += [f"{p}: shape {got[p]}, the pruned config expects {expected[p]}"
               for p in sorted(expected.keys() & got.keys()) if got[p] != expected[p]]
  if problems:
    raise errors.CheckpointError(
        "The pruned parameters do not match the pruned model "
        f"(heads_per_layer={cfg.layer_heads}); the variables do not fit the config: "
        + "; ".join(problems))
