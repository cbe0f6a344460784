"""The run-config schema shared by every file in configs/.

Each config file starts from `base_config()` and changes what its run needs, so a
key that exists in one config exists in all of them with the same meaning.
"""
import ast
import importlib.util
import pathlib

import ml_collections


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()

  c.model = ml_collections.ConfigDict(dict(
      kind="allatt",               # 'allatt' or 'txl'
      vocab_size=256,              # must equal the dataset's vocabulary size
      num_layers=2,
      d_model=64,
      num_heads=4,
      heads_per_layer=ml_collections.FieldReference(None, field_type=tuple),
      num_persistent=0,            # N persistent vectors per head (All-att)
      d_ff=0,                      # feed-forward width (TXL)
      rel_pos="learned",           # or 'sinusoidal'
      max_relative_len=0,          # learned table length; 0 = train.seq_len + train.mem_len
      same_length=False,
      head_block=0,                # heads per step of the attention loop; 1 is fastest on CPU
      remat=False,                 # recompute attention weights in the backward pass
      dropout=0.1,
      dropout_attn=0.2,
      dropout_emb=0.1,
      cutoffs=(),
      div_val=1,
      tie_projs=ml_collections.FieldReference(None, field_type=tuple),
      dtype="float32",             # compute dtype ('bfloat16' on accelerators)
  ))

  # Head gates (pruning). Disabled = baseline training.
  c.gates = ml_collections.ConfigDict(dict(
      enabled=False,
      init=2.0,                    # technique 2: π = 2 (≈ 88% open); 0 for the ablation
      temperature=1.0 / 3.0,
      hard=True,                   # straight-through discrete gates
      scale_output=True,           # technique 3: s_g = H / Σg
      lam=0.0,                     # λ of the L0 term
      l0_warmup_steps=4000,        # technique 1: λ rises linearly; 0 = no warm-up
      freeze_step=16000,           # gates stop updating and become deterministic
      # Peak learning rate of the gate logits; None = train.learning_rate (the paper).
      # Short runs need more: LAMB moves a logit by about 1-2 x lr per step.
      learning_rate=ml_collections.FieldReference(None, field_type=float),
      # A budget instead of λ (budget.py; at most one, lam=0): a Lagrangian controller
      # prunes to this head sparsity, non-embedding parameter count or MACs per token.
      target_sparsity=ml_collections.FieldReference(None, field_type=float),
      target_params=ml_collections.FieldReference(None, field_type=int),
      target_macs=ml_collections.FieldReference(None, field_type=float),
      lagrangian_lr=1e-3,          # ascent rate of the controller's multipliers
  ))

  c.data = ml_collections.ConfigDict(dict(
      name="wikitext_chars",
      manual_dir=ml_collections.FieldReference(None, field_type=str),
      data_dir=ml_collections.FieldReference(None, field_type=str),
      # Dataset 'text_files' only (your own folder, see the README):
      level="",                    # 'word' (the default), 'char' or 'byte'
      files="train.txt,valid.txt,test.txt",  # the train,valid,test files in manual_dir
      min_count=1,                 # word level: train words seen fewer times -> <unk>
      max_vocab=0,                 # at most this many types, the rarest -> <unk>; 0 = all
      clean="",                    # char level: 'text8' = lower-case a-z and space only
  ))

  c.train = ml_collections.ConfigDict(dict(
      batch_size=16,               # global batch (rows of the segment stream)
      seq_len=64,                  # T
      mem_len=64,                  # S
      num_steps=1000,
      learning_rate=1e-2,          # peak, after linear warm-up
      final_learning_rate=1e-4,    # end of the cosine decay
      warmup_steps=100,
      weight_decay=0.0,
      grad_clip=0.25,
      grad_accum_steps=1,
      seed=0,
      log_every_steps=50,
      # A step whose loss or gradient is NaN/inf stops the run (False), or is skipped:
      # its update is dropped, the memory restarts, and `nonfinite_steps` counts it.
      skip_nonfinite_steps=False,
  ))

  c.eval = ml_collections.ConfigDict(dict(
      batch_size=16,
      seq_len=64,
      mem_len=64,
      every_steps=500,
      max_batches=0,               # 0 = the whole split; >0 caps periodic evals only
  ))

  c.checkpoint = ml_collections.ConfigDict(dict(every_steps=500, keep=3))
  c.mesh = ml_collections.ConfigDict(dict(data=-1, model=1))   # -1 fills the rest
  c.init_from = ""                 # baseline checkpoint dir that a pruning run starts from
  return c


def as_txl(c: ml_collections.ConfigDict, d_model: int) -> ml_collections.ConfigDict:
  """The Transformer-XL of an All-att config: same depth and heads, FF of 4d, no N."""
  c.model.update(dict(kind="txl", d_model=d_model, d_ff=4 * d_model, num_persistent=0))
  return c


def paper_pruning(c: ml_collections.ConfigDict, lam: float,
                  init_from: str) -> ml_collections.ConfigDict:
  """The paper's pruning recipe (Shim et al. 2021, §4.1.2) on top of a baseline config.

  Gates at π = 2, λ warmed up over 4K steps, gates frozen at 16K of 80K steps, peak
  learning rate 1e-3 decayed to 1e-4.
  """
  c.init_from = init_from
  c.gates.update(dict(enabled=True, lam=lam, init=2.0, l0_warmup_steps=4000,
                      freeze_step=16_000))
  c.train.update(dict(num_steps=80_000, learning_rate=1e-3, final_learning_rate=1e-4))
  return c


def parse_arg(arg: str | None, **defaults):
  """Parses a config argument like 'lam=0.015,tiny' against typed defaults.

  A bare word sets a boolean default to True. Values keep the type of their default.
  """
  values = ml_collections.ConfigDict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, has_value, raw = item.partition("=")
    if key not in values:
      raise ValueError(f"Unknown config argument {key!r}; known: {sorted(defaults)}.")
    if not has_value:
      values[key] = True
      continue
    default = defaults[key]
    if isinstance(default, str):
      values[key] = raw
    else:
      values[key] = type(default)(ast.literal_eval(raw))
  return values


def load(path, arg: str | None = None) -> ml_collections.ConfigDict:
  """`get_config(arg)` of a config file, as `--config=path:arg` would give it."""
  path = pathlib.Path(path)
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def load_sibling(this_file: str, name: str, arg: str | None = None):
  """The config of another file in the same folder, so variants reuse one recipe."""
  return load(pathlib.Path(this_file).with_name(name), arg)
