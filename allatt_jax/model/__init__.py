"""The language models: All-attention and Transformer-XL layers, attention cores,
adaptive input and softmax, head gates."""
