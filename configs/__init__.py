"""The shipped run configs (`qnpu quantize --config NAME`), one YAML file each. This directory
is the repository's top-level configs/, installed as the package data `qnpu_jax.configs`."""
