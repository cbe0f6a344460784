r"""All-att baseline on text8 (character level) at the paper's size (Shim et al. 2021, §4.1).

12 layers, d=512, H=8, N=2048, plain tied softmax over 27 characters; LAMB, batch 64,
T = S = 512, warm-up 4K to 1e-2, cosine to 1e-4 over 160K steps.

Recipe sources (config_base.py lists each): the paper's where it states them, the
official code's where it is silent (official LAMB, gates at 10x the learning rate,
same_length, W_O bias, LayerNorm eps 1e-5, no final LayerNorm, q·P_K persistent
logits), output scaling s_g and masked empty memory kept on purpose.

  python -m allatt_jax.main --config=configs/text8_base.py --workdir=$WORKDIR \
      --config.data.manual_dir=/path/to/text8_folder

`configs/text8_base.py:tiny` is a 2-layer variant for tests and smoke runs.
"""
from allatt_jax.config import config_base


def get_config(arg=None):
  args = config_base.parse_arg(arg, tiny=False)
  c = config_base.base_config()
  c.data.name = "text8"
  c.model.update(dict(kind="allatt", vocab_size=27, num_layers=12, d_model=512,
                      num_heads=8, num_persistent=2048, dtype="bfloat16"))
  c.train.update(dict(
      batch_size=64, seq_len=512, mem_len=512, num_steps=160_000, learning_rate=1e-2,
      final_learning_rate=1e-4, warmup_steps=4000, log_every_steps=100))
  c.eval.update(dict(batch_size=16, seq_len=512, mem_len=512, every_steps=4000))
  c.checkpoint.update(dict(every_steps=4000, keep=3))
  if args.tiny:
    c.model.update(dict(num_layers=2, d_model=64, num_heads=4, num_persistent=32,
                        dtype="float32"))
    c.train.update(dict(batch_size=4, seq_len=32, mem_len=32, num_steps=20, warmup_steps=5))
    c.eval.update(dict(batch_size=4, seq_len=32, mem_len=32, every_steps=10, max_batches=4))
  return c
