r"""Experiment suites at CPU scale on the embedded character corpus (docs/experiments.md).

The baseline is a 4-layer All-att (d=128, H=8) with N = 4d = 512 persistent vectors
per head, so that, as in the paper, an All-att and a Transformer-XL (d_ff = 4d) of
the same width have the same number of non-embedding parameters. It trains on
`wikitext_chars` (shipped with the package). Every other run of a suite starts from
it (see allatt_jax/experiments/runs.py); the `experiments` section sets them up.

  python -m allatt_jax.experiments --suite=lambda_sweep --config=configs/exp_chars.py \
      --workdir=/tmp/exp_chars

Suites: lambda_sweep, ablation, txl_widths, heuristics, budget, distill, persistent, or
all of them.
Rerunning a suite reuses its finished runs and resumes an interrupted one.
`configs/exp_chars.py:tiny` is the seconds-per-run variant the tests use.
"""
import ml_collections

from allatt_jax.config import config_base


def get_config(arg=None):
  args = config_base.parse_arg(arg, tiny=False)
  c = config_base.base_config()
  c.data.name = "wikitext_chars"
  # vocab_size 0: the dataset's (27 here), so a suite runs on your own text as it is.
  c.model.update(dict(kind="allatt", vocab_size=0, num_layers=4, d_model=128, num_heads=8,
                      num_persistent=512, dropout=0.0, dropout_attn=0.0, dropout_emb=0.0,
                      head_block=1))
  c.train.update(dict(batch_size=16, seq_len=32, mem_len=32, num_steps=3000,
                      learning_rate=3e-3, final_learning_rate=1e-4, warmup_steps=100,
                      log_every_steps=100))
  c.eval.update(dict(batch_size=16, seq_len=32, mem_len=32, every_steps=0))
  c.checkpoint.update(dict(every_steps=500, keep=1))

  c.experiments = ml_collections.ConfigDict(dict(
      # Pruning runs (and every fine-tuning) start from the baseline with this recipe:
      # the paper's shape (gates trained for the first 2/3, then frozen; lower
      # learning rate), shortened; the gates at 10x the learning rate (official code).
      prune_train=dict(num_steps=1500, learning_rate=1e-3, warmup_steps=100),
      prune_gates=config_base.pruning_gates(init=2.0, l0_warmup_steps=200,
                                            freeze_step=1000, lagrangian_lr=1e-3),
      lambdas=(0.01, 0.02, 0.04, 0.08),
      seeds=(0, 1),                    # pruning / fine-tuning seeds (one baseline)
      ablation_lambda=0.04,
      txl_widths=(128, 96, 80, 64),
      # Every pruner of allatt_jax/experiments/heuristics.py.
      heuristics=("michel", "entropy", "sparsity", "distribution", "magnitude", "random"),
      heuristic_lambdas=(0.04, 0.08),  # heuristics prune as many heads as these L0 runs
      random_seeds=(0, 1),
      importance_batches=32,           # training batches the heuristic scores read
      michel_step_fraction=0.1,
      # (budget key, value): a sparsity, or params / MACs as a fraction of the baseline's.
      budgets=(("target_sparsity", 0.25), ("target_sparsity", 0.5),
               ("target_sparsity", 0.75), ("target_params", 0.6), ("target_macs", 0.6)),
      budget_seeds=(0,),
      budget_reference_lambdas=(0.04, 0.08, 0.16),   # fixed-λ runs the budgets meet
      # --suite=distill: these head sparsities, each plain and with each variant's
      # distill section (the baseline as teacher; allatt_jax/training/distill.py).
      distill_sparsities=(0.25, 0.5, 0.75),
      distill_variants=dict(
          logit=dict(weight=0.5, temperature=1.0, hidden_weight=0.0, kl_clusters="all"),
          logit_hidden=dict(weight=0.5, temperature=1.0, hidden_weight=0.1,
                            kl_clusters="all")),
      # --suite=persistent: MAC budgets (fractions of the baseline's), each pruned by
      # heads only, by groups of this many persistent slots only, and by both, plain
      # and distilling with this variant; each export's inference speed on this many
      # valid batches a round, against the baseline's (evaluation/speed.py).
      persistent_budgets=(0.5, 0.25),
      persistent_group=64,
      persistent_distill="logit",
      speed_batches=5,
  ))
  if args.tiny:
    c.model.update(dict(num_layers=2, d_model=32, num_heads=4, num_persistent=32))
    c.train.update(dict(batch_size=4, seq_len=16, mem_len=16, num_steps=30, warmup_steps=5,
                        log_every_steps=10))
    # Every run scores the whole valid and test splits: in wide batches, few steps.
    c.eval.update(dict(batch_size=128, seq_len=16, mem_len=16))
    c.checkpoint.every_steps = 30
    e = c.experiments
    e.prune_train.update(dict(num_steps=100, warmup_steps=5))
    # Strong, early pressure (gates at 100x the learning rate) so that a few tiny steps
    # close heads.
    e.prune_gates.update(dict(l0_warmup_steps=20, freeze_step=80, learning_rate=0.1,
                              lagrangian_lr=0.01))
    e.update(dict(lambdas=(0.2,), seeds=(0,), ablation_lambda=0.2, txl_widths=(16,),
                  heuristic_lambdas=(0.2,), random_seeds=(0,), importance_batches=2,
                  budgets=(("target_sparsity", 0.5),), budget_reference_lambdas=(0.2,),
                  distill_sparsities=(0.5,), persistent_budgets=(0.6,),
                  persistent_group=8, speed_batches=2))
  return c
