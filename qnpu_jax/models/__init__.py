"""Model configs, loaders and the float forward."""

from qnpu_jax.models.config import ModelConfig, RopeConfig
from qnpu_jax.models.hf import load_hf_dir, save_hf_dir
from qnpu_jax.models.llama import forward, generate, init_random_params, token_nll
from qnpu_jax.models.load import BUILTIN_MODELS, LoadedModel, load_model
from qnpu_jax.models.tokenizer import Tokenizer

__all__ = [
    "BUILTIN_MODELS",
    "LoadedModel",
    "ModelConfig",
    "RopeConfig",
    "Tokenizer",
    "forward",
    "generate",
    "init_random_params",
    "load_hf_dir",
    "load_model",
    "save_hf_dir",
    "token_nll",
]
