"""The suite's own settings (tests/suite_environment.py, tests/conftest.py): what every test
compiles with."""

from __future__ import annotations

import os

import jax
import pytest


def test_tests_compile_with_xla_optimizations_off_unless_the_environment_says():
    want = os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower() in ("1", "true")
    assert jax.config.read("jax_disable_most_optimizations") is want


@pytest.mark.xla_optimized
def test_a_test_marked_xla_optimized_compiles_at_the_default_level():
    assert jax.config.read("jax_disable_most_optimizations") is False
    assert float(jax.jit(lambda x: x * 2.0)(1.5)) == 3.0
