r"""All-att baseline on WikiText-103 at the paper's size (Shim et al. 2021, §4.1).

16 layers, d=512, H=8, N=2048 persistent vectors, adaptive input/softmax; LAMB,
batch 96, T = S = 192, warm-up 4K to 1e-2, cosine to 1e-4 over 160K steps.

Recipe sources (config_base.py lists each): the paper's where it states them, the
official code's where it is silent (official LAMB, gates at 10x the learning rate,
same_length, W_O bias, LayerNorm eps 1e-5, no final LayerNorm, q·P_K persistent
logits), output scaling s_g and masked empty memory kept on purpose.

  python -m allatt_jax.main --config=configs/wt103_base.py --workdir=$WORKDIR \
      --config.data.manual_dir=/path/to/wikitext-103

`configs/wt103_base.py:tiny` is a 2-layer variant for tests and smoke runs.
"""
from allatt_jax.config import config_base


def get_config(arg=None):
  args = config_base.parse_arg(arg, tiny=False)
  c = config_base.base_config()
  c.data.name = "wikitext103"
  c.model.update(dict(
      kind="allatt", vocab_size=267_735, num_layers=16, d_model=512, num_heads=8,
      num_persistent=2048, cutoffs=(20_000, 40_000, 200_000), div_val=4,
      tie_projs=(False, True, True, True)))
  c.train.update(dict(
      batch_size=96, seq_len=192, mem_len=192, num_steps=160_000, learning_rate=1e-2,
      final_learning_rate=1e-4, warmup_steps=4000, log_every_steps=100))
  c.eval.update(dict(batch_size=16, seq_len=192, mem_len=192, every_steps=4000))
  c.checkpoint.update(dict(every_steps=4000, keep=3))
  c.model.dtype = "bfloat16"
  if args.tiny:
    c.model.update(dict(num_layers=2, d_model=64, num_heads=4, num_persistent=32,
                        dtype="float32"))
    c.train.update(dict(batch_size=4, seq_len=16, mem_len=16, num_steps=20, warmup_steps=5))
    c.eval.update(dict(batch_size=4, seq_len=16, mem_len=16, every_steps=10, max_batches=4))
  return c
