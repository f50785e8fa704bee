"""Model configs (`config`), loaders (`load`, `hf`, `gguf`), the tokenizer (`tokenizer`), the float
forward (`llama`) and the forward under a quantization plan (`taps`).

Import the submodule you need: `config` and `tokenizer` never pull in JAX, which the integer
artifact readers rely on.
"""
