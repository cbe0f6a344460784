"""The run-config schema shared by every file in configs/.

Each config file starts from `base_config()` and changes what its run needs, so a
key that exists in one config exists in all of them with the same meaning.

Where each default of the recipe comes from. The paper (Shim et al. 2021) decides
what it states; where it is silent, the released code behind its numbers decides;
the other form stays selectable:

  paper      LAMB; warm-up 4K then cosine; peak 1e-2 (baseline) / 1e-3 (pruning);
             dropout 0.2 on attention weights, 0.1 elsewhere; hard-concrete gates with
             straight-through hard gates, π init 2, λ warm-up, output scaling s_g
             (`gates.scale_output`: the official code has it commented out); gates
             frozen at 16K of 80K pruning steps.
  official   LAMB form (`train.optimizer='lamb'`: no bias correction, eps 1e-8,
             weight norm clamped to [0, 10]; 'optax_lamb' is optax's); gate logits at
             10x the model's learning rate (`gates.lr_multiplier`); no weight decay on
             LayerNorms and gates (`train.weight_decay_exclude`; we also spare biases,
             the official code decays them); β = 1/3 (`gates.temperature`; Louizos:
             2/3); a deterministic gate open at π >= 0 (`gates.open_at_zero`);
             `model.same_length` with S + 1 keys per query (`model.same_length_keys`;
             Transformer-XL: S); W_O with a bias (`model.out_bias`); LayerNorm eps
             1e-5 (`model.layer_norm_eps`); no LayerNorm after the last layer
             (`model.final_norm`); persistent logits q·P_K
             (`model.persistent_content_bias`: (q + u)·P_K).
  ours       empty memory slots at a stream's start are masked (the official model
             attends to zero-filled slots: its first segment's scores depend on the
             padding, ours are those of a model without memory); budgets instead of
             λ (`gates.target_*`, budget.py: target warm-up, sharpened count, exactly
             n* heads kept at the freeze); `model.vocab_size` 0 = the dataset's;
             an adaptive softmax for own word-level text (`model.auto_cutoffs`);
             gates on groups of persistent slots (`gates.persistent_group`, off by
             default), in the budgets beside heads.
"""
import ast
import importlib.util
import pathlib

import ml_collections


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()

  c.model = ml_collections.ConfigDict(dict(
      kind="allatt",               # 'allatt' or 'txl'
      vocab_size=0,                # 0: the dataset's; a set value must equal it
      num_layers=2,
      d_model=64,
      num_heads=4,
      heads_per_layer=ml_collections.FieldReference(None, field_type=tuple),
      num_persistent=0,            # N persistent vectors per head (All-att)
      d_ff=0,                      # feed-forward width (TXL)
      rel_pos="learned",           # or 'sinusoidal'
      max_relative_len=0,          # learned table length; 0 = train.seq_len + train.mem_len
      # Recipe choices the paper leaves open, as the official code makes them (the
      # other form stays selectable; model.py documents each):
      same_length=True,            # every query sees the same number of context keys
      same_length_keys="mem_len+1",  # official window; 'mem_len' = Transformer-XL's
      out_bias=True,               # W_O has a bias (official); False = none
      layer_norm_eps=1e-5,         # official (PyTorch's); flax's default is 1e-6
      final_norm=False,            # official: no LayerNorm after the last layer
      persistent_content_bias=False,  # persistent logits q·P_K (official); True: (q+u)·P_K
      head_block=0,                # heads per step of the attention loop; 1 is fastest on CPU
      remat=False,                 # recompute attention weights in the backward pass
      # The attention core (ours; numerically the same model either way): 'xla' (XLA
      # ops, attention_kernel.py), 'pallas' (fused GPU kernels, attention_pallas.py;
      # an error where they cannot run) or 'auto' (the kernels on a GPU where they
      # compile and agree with XLA on a trial problem, XLA elsewhere). head_block and
      # remat apply to the XLA core only: the kernels keep no weights anyway.
      attention_impl="auto",
      dropout=0.1,
      dropout_attn=0.2,
      dropout_emb=0.1,
      cutoffs=(),
      div_val=1,
      tie_projs=ml_collections.FieldReference(None, field_type=tuple),
      # Own text at word level (text_files) with neither cutoffs nor div_val set: an
      # adaptive input/softmax sized from the vocabulary (cutoffs at 7.5/15/75% of it,
      # div_val 4) where a plain softmax would cost more than all the layers (ours,
      # after Transformer-XL on its large word-level corpora). False: the plain one.
      auto_cutoffs=True,
      dtype="float32",             # compute dtype ('bfloat16' on accelerators)
      # Attention scores and softmax weights kept in memory in the compute dtype
      # ('compute'; max and sum accumulate in float32) or in 'float32' (ours: with a
      # float32 model both are the same; in bfloat16 'compute' halves their traffic).
      score_dtype="compute",
      # The output layer at matmul speed (ours; vocab_logsumexp.py): vocabulary rows per
      # block of a softmax's log-sum-exp (0 = sized to the device's memory: one matmul
      # where the logits fit), and an adaptive softmax's tail clusters run only for
      # the positions whose target is theirs, up to tail_capacity x their share of the
      # training tokens (0 = every position pays for every tail, as in Transformer-XL
      # and the official code, which gathers with dynamic shapes instead).
      vocab_block=0,
      tail_capacity=2.0,
      # Each cluster's share of the training tokens, head first; () = counted from the
      # dataset when a run reads it, else a Zipf's-law estimate.
      cluster_fractions=(),
  ))

  # Head gates (pruning). Disabled = baseline training.
  c.gates = ml_collections.ConfigDict(dict(
      enabled=False,
      init=2.0,                    # technique 2: π = 2 (≈ 88% open); 0 for the ablation
      temperature=1.0 / 3.0,
      hard=True,                   # straight-through discrete gates
      scale_output=True,           # technique 3: s_g = H / Σg (the paper; the official
                                   # code has it commented out)
      open_at_zero=True,           # deterministic gate open iff π >= 0 (official); False: > 0
      lam=0.0,                     # λ of the L0 term
      l0_warmup_steps=4000,        # technique 1: λ rises linearly; 0 = no warm-up
      freeze_step=16000,           # gates stop updating and become deterministic
      # Gate logits train at lr_multiplier x the model's schedule (10 in the official
      # code; the paper is silent). A set learning_rate replaces that peak.
      lr_multiplier=10.0,
      learning_rate=ml_collections.FieldReference(None, field_type=float),
      # A budget instead of λ (budget.py; at most one, lam=0): a Lagrangian controller
      # prunes to this head sparsity, non-embedding parameter count or MACs per token.
      target_sparsity=ml_collections.FieldReference(None, field_type=float),
      target_params=ml_collections.FieldReference(None, field_type=int),
      target_macs=ml_collections.FieldReference(None, field_type=float),
      lagrangian_lr=1e-3,          # ascent rate of the controller's multipliers
      # The controller's count σ(k·π) sharpens from k = 1 after the target warm-up to
      # this k at the freeze, towards the heads the export keeps (ours; 1 = the expected
      # count of Wang et al. 2020 and CoFi). The freeze keeps exactly the budget's heads
      # either way, ranked by logit where the gates disagree (budget.py).
      budget_sharpness=10.0,
      # Steps over which a budget's target moves to its head count (ours); None = 60%
      # of the steps before the freeze (budget.target_warmup_steps says why).
      budget_warmup_steps=ml_collections.FieldReference(None, field_type=int),
      # A budget that keeps no head (a model without attention) is refused unless this
      # asks for it (ours).
      allow_empty=False,
      # Gates on persistent memory (ours, after CoFi's gates on feed-forward
      # dimensions; the paper gates heads only): one hard-concrete gate per group of
      # this many persistent slots of each head (it divides model.num_persistent; 0 =
      # off, the paper's recipe). A closed group's keys and values leave the softmax
      # (attention.py). Budgets (target_params, target_macs) then count heads and
      # groups together; target_sparsity stays a fraction of heads.
      persistent_group=0,
      heads=True,                  # gate the heads (the paper); False with
                                   # persistent_group > 0 prunes persistent groups only
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
      # 'lamb': the official LAMB (no bias correction, eps 1e-8, weight norm clamped to
      # [0, lamb_max_weight_norm]); 'optax_lamb': optax.lamb (optim.py has both).
      optimizer="lamb",
      lamb_eps=1e-8,
      lamb_max_weight_norm=10.0,
      weight_decay=0.0,
      # Leaves whose 'a/b/c' path matches one of these regexes get no weight decay (gate
      # logits never do). The official code exempts only LayerNorms: use ('norm',).
      weight_decay_exclude=("norm", "bias"),
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

  # Distillation from the unpruned model while pruning (ours, after CoFi, Xia et al.
  # 2022, and Minitron, Muralidharan et al. 2024; the paper has none): the teacher is
  # the `init_from` model, frozen. Off (weight = hidden_weight = 0) is the paper's recipe.
  c.distill = ml_collections.ConfigDict(dict(
      weight=0.0,                  # α: loss (1 − α)·CE + α·τ²·KL(teacher_τ ‖ student_τ)
      temperature=1.0,             # τ
      hidden_weight=0.0,           # β: + β·Σ_layers MSE(student, teacher layer outputs)
      # With an adaptive softmax: 'all' = the exact full-vocabulary KL (every tail
      # cluster, in vocabulary blocks); 'head' = the head cluster's KL only (its tokens
      # and the tail clusters' probabilities), a lower bound at a fraction of the cost.
      kl_clusters="all",
  ))

  c.checkpoint = ml_collections.ConfigDict(dict(every_steps=500, keep=3))
  c.mesh = ml_collections.ConfigDict(dict(data=-1, model=1))   # -1 fills the rest
  c.init_from = ""                 # baseline checkpoint dir that a pruning run starts from
  return c


def pruning_gates(**overrides) -> ml_collections.ConfigDict:
  """A pruning stage's whole `gates` section (enabled), for a pipeline or experiment
  config: every gate key, the budget targets included, can then be set by flag."""
  gates = base_config().gates
  gates.update(dict(enabled=True, **overrides))
  return gates


def txl_model(d_model: int) -> dict:
  """The model keys that make an All-att config its Transformer-XL: same depth and
  heads, a feed-forward of 4d, no persistent vectors."""
  return dict(kind="txl", d_model=d_model, d_ff=4 * d_model, num_persistent=0)


def paper_pruning(config: ml_collections.ConfigDict, lam: float, init_from: str
                  ) -> ml_collections.ConfigDict:
  """The paper's pruning recipe (Shim et al. 2021, §4.1.2) on top of a baseline config
  file's ConfigDict, which it changes (so that flags still override it) and returns.

  Gates at π = 2, λ warmed up over 4K steps, gates frozen at 16K of 80K steps, peak
  learning rate 1e-3 decayed to 1e-4.
  """
  config.train.update(dict(num_steps=80_000, learning_rate=1e-3, final_learning_rate=1e-4))
  config.gates.update(dict(enabled=True, lam=lam, init=2.0, l0_warmup_steps=4000,
                           freeze_step=16_000))
  config.init_from = init_from
  return config


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
  return module.get_config(*([] if arg is None else [arg]))


def load_sibling(this_file: str, name: str, arg: str | None = None):
  """The config of another file in the same folder, so variants reuse one recipe."""
  return load(pathlib.Path(this_file).with_name(name), arg)
