"""allatt_jax: All-attention Transformer LMs with layer-wise L0 head pruning."""
import os

# TensorFlow is only a data-preparation dependency here (TFDS, clu's writers); its C++
# start-up chatter would bury the training log.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
