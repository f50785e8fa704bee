"""Shared fixtures: the real model is loaded once per session (compilation dominates on CI)."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from qnpu_jax.models import LoadedModel, ModelConfig, init_random_params, load_model

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    return ModelConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg: ModelConfig) -> dict:
    return init_random_params(tiny_cfg, jax.random.key(0))


@pytest.fixture(scope="session")
def wikitext_test_path() -> Path:
    path = SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"
    if not path.is_file():
        pytest.fail(f"shared evaluation data missing: {path}")
    return path
