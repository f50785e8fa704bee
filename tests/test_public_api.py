"""The public API: `import qnpu_jax as qj` gives every name README's quick start uses, without
loading JAX until one of them is touched."""

import subprocess
import sys

import qnpu_jax as qj

ISSUE_NAMES = (
    "load_model",
    "quantize",
    "load_run",
    "QuantizedModel",
    "recipes",
    "steps",
    "export_run",
    "open_engine",
    "perplexity",
)


def test_every_public_name_resolves_to_its_defining_module():
    assert set(ISSUE_NAMES) <= set(qj.__all__)
    assert set(qj.__all__) == {"QnpuError", "__version__", *qj._WHERE}
    for name in qj.__all__:
        value = getattr(qj, name)
        assert value is not None, name
    assert qj.recipes.__name__ == "qnpu_jax.pipeline.recipes"
    assert qj.open_engine.__module__ == "qnpu_jax.runtime.engines"
    assert sorted(dir(qj)) == sorted(qj.__all__)


def test_an_unknown_name_is_an_attribute_error():
    try:
        qj.not_a_name  # noqa: B018
    except AttributeError as e:
        assert "not_a_name" in str(e)
    else:
        raise AssertionError("qj.not_a_name resolved")


def test_importing_the_package_loads_no_jax():
    code = "import sys, qnpu_jax; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
