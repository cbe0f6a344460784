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
import numpy as np

from allatt_jax.config import errors
from allatt_jax.pruning import gate_values
from allatt_jax.model import transformer as model_lib

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


def running_model_config(cfg: model_lib.ModelConfig, variables) -> model_lib.ModelConfig:
  """`cfg`, or for a gated model the ungated one of its open heads and persistent
  groups (its export's)."""
  if not cfg.gated:
    return cfg
  return _pruned_config(cfg, *_kept_units(cfg, gate_values.read(cfg, variables["gates"])))


def remove_heads(cfg: model_lib.ModelConfig, variables,
                 heads: Mapping[int, Iterable[int]] | Sequence[np.ndarray] | None = None,
                 slots: Mapping[int, Mapping[int, Iterable[int]]] | None = None
                 ) -> tuple[model_lib.ModelConfig, dict]:
  """The smaller, ungated model without the chosen heads: the one head surgery.

  A gated model (a pruning run) also loses the heads its deterministic gates close,
  and its gates fold into the survivors' W_O slices, so the result computes its
  deterministic outputs: that is its export. An ungated model keeps its other heads
  unchanged (hard gates, no output scale). Persistent slots go with their head, and
  a head also loses the slots of its closed persistent groups (`gate_values`)
  and those `slots` names; a closed group takes no attention mass, so removing it
  changes no output. Where the heads of a layer then keep different numbers of slots,
  they are ordered by that number (most first) and each layer's arrays hold the
  largest (`transformer.ModelConfig.persistent_slots`; attention/relative.py computes
  each head with its own slots only).

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
  if cfg.gated and not variables.get("gates"):
    raise errors.CheckpointError(
        "The variables have no 'gates' collection: this run has no head gates, so "
        "there is nothing to prune. Export needs a pruning run (gates.enabled=True), "
        "not a baseline.")
  gates = gate_values.read(cfg, variables.get("gates"), closed=removed)
  return cut_closed(cfg, variables["params"], gates, removed_slots)


def cut_closed(cfg: model_lib.ModelConfig, params, gates: gate_values.Gates,
               removed_slots: Mapping[int, Mapping[int, list[int]]] | None = None
               ) -> tuple[model_lib.ModelConfig, dict]:
  """The smaller, ungated model of the heads and persistent slots `gates`
  (`gate_values.read`'s) keeps open, less `removed_slots`: `remove_heads` once the
  gates are read, for a caller that reads them itself (a pruning run's export, which
  also counts the heads they keep)."""
  keep, kept_slots = _kept_units(cfg, gates, removed_slots)
  return _cut_heads(cfg, params, gates.out_factors, keep, kept_slots)


def _kept_units(cfg: model_lib.ModelConfig, gates: gate_values.Gates,
                removed_slots: Mapping[int, Mapping[int, list[int]]] | None = None
                ) -> tuple[list[np.ndarray], list[list[np.ndarray]] | None]:
  """(per layer, the heads kept in their order in the smaller model; per layer and
  kept head, its persistent slots kept, or None where every kept head keeps all N)."""
  keep, slots = [], []
  for i, heads in enumerate(gates.surviving_heads):
    current = cfg.head_slots(i)
    head_slots = []
    for h in heads:
      kept_h = (np.arange(current[h]) if gates.kept_slots[i] is None
                else gates.kept_slots[i][h])
      gone = (removed_slots or {}).get(i, {}).get(int(h), ())
      head_slots.append(np.setdiff1d(kept_h, gone))
    # Most slots first (stably), so that heads of equal counts sit together.
    order = sorted(range(len(heads)), key=lambda j: -len(head_slots[j]))
    keep.append(heads[order])
    slots.append([head_slots[j] for j in order])
  full = cfg.kind == "allatt" and cfg.num_persistent
  if cfg.persistent_slots is None and all(
      len(s) == full for layer in slots for s in layer):
    return list(gates.surviving_heads), None
  return keep, slots


def _pruned_config(cfg: model_lib.ModelConfig, keep, slots) -> model_lib.ModelConfig:
  """The config of the model keeping heads `keep` with `slots` (`_kept_units`)."""
  return dataclasses.replace(
      cfg, heads_per_layer=tuple(len(k) for k in keep), gated=False,
      persistent_slots=None if slots is None else tuple(
          tuple(len(s) for s in layer) for layer in slots))


def _cut_heads(cfg: model_lib.ModelConfig, params, out_factors: list[np.ndarray],
               keep, slots) -> tuple[model_lib.ModelConfig, dict]:
  """Slices out the heads `keep` leaves out and the slots `slots` does (padding each
  layer's persistent arrays to its largest count), and folds each kept head's g_i · s_g
  (`out_factors`) into W_O."""
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
      sliced = sliced * out_factors[i][keep[i]][:, None, None]
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
