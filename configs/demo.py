r"""The demo: train, prune, export and compare a small All-att on the embedded corpus.

Runs on a laptop CPU in minutes with no download: a character-level All-att baseline
on `wikitext_chars` (WikiText-2 raw text cleaned text8-style, shipped in the
package), then a pruning run from it with the paper's three techniques that also
learns from it (distillation of its next-token distribution, `prune_distill`), the
export of the pruned model, and a report comparing both (bpc, parameters, tokens/s).
`--config.pipeline.prune_distill.weight=0` prunes as the paper does.
`model.vocab_size` is 0: taken from the dataset, so other data needs no other value.

  python -m allatt_jax.main --config=configs/demo.py --workdir=/tmp/allatt_demo

`configs/demo.py:tiny` is a seconds-long variant for tests.
"""
import ml_collections

from allatt_jax.config import config_base


def get_config(arg=None):
  args = config_base.parse_arg(arg, tiny=False)
  c = config_base.base_config()
  c.data.name = "wikitext_chars"
  c.model.update(dict(kind="allatt", vocab_size=0, num_layers=4, d_model=128, num_heads=8,
                      num_persistent=64, dropout=0.0, dropout_attn=0.0, dropout_emb=0.0))
  c.train.update(dict(batch_size=16, seq_len=32, mem_len=32, num_steps=2500,
                      learning_rate=3e-3, final_learning_rate=1e-4, warmup_steps=100,
                      log_every_steps=100))
  c.eval.update(dict(batch_size=16, seq_len=32, mem_len=32, every_steps=0))
  c.checkpoint.update(dict(every_steps=1000, keep=2))

  # The pruning stage: `prune_train` changes the baseline's train section for the
  # second run, `prune_gates` is its gates section, with the paper's shape shortened
  # (gates trained for the first 2/3, then frozen; lower learning rate; the gates at
  # 10x it, as in the official code). λ = 0.05 by default; a size instead:
  # --config.pipeline.prune_gates.target_sparsity=0.5 (or target_params, target_macs).
  c.pipeline = ml_collections.ConfigDict(dict(
      prune_train=dict(num_steps=1500, learning_rate=1e-3, warmup_steps=100),
      prune_gates=config_base.pruning_gates(lam=0.05, l0_warmup_steps=200,
                                            freeze_step=1000),
      # The pruning stage learns from the baseline (allatt_jax/training/distill.py): logits only,
      # α = 0.5, τ = 1, the best variant of docs/experiments.md's distill suite (−0.01
      # to −0.08 bpc at 25-75% of heads removed). weight=0 is the paper's recipe.
      prune_distill=config_base.base_config().distill.copy_and_resolve_references(),
      # Valid batches each timed run of the speed comparison reads, in each of its
      # interleaved rounds (allatt_jax/evaluation/speed.py): many short rounds agree
      # from run to run better than a few long ones on a shared machine.
      speed_batches=10,
  ))
  c.pipeline.prune_distill.weight = 0.5
  # With an adaptive softmax (own text at word level): the head cluster's KL, which on
  # WikiText-2 words matched the exact KL's test perplexity at 2.4x its pruning step
  # speed (ours, docs/experiments.md). kl_clusters='all' is the exact KL. With a plain
  # softmax (characters) there is one cluster, and both are the exact KL.
  c.pipeline.prune_distill.kl_clusters = "head"
  if args.tiny:
    c.model.update(dict(num_layers=2, d_model=32, num_heads=4, num_persistent=16))
    c.train.update(dict(batch_size=4, seq_len=16, mem_len=16, num_steps=30, warmup_steps=5,
                        log_every_steps=10))
    # A run ends by scoring the whole valid and test splits (120,331 characters each):
    # wide rows make that a few hundred steps.
    c.eval.update(dict(batch_size=64, seq_len=16, mem_len=16, max_batches=8))
    c.checkpoint.every_steps = 20
    c.pipeline.prune_train.update(dict(num_steps=30, warmup_steps=5))
    c.pipeline.prune_gates.update(dict(l0_warmup_steps=5, freeze_step=15))
    c.pipeline.speed_batches = 2
  return c
