"""Export of the integer-only model: the on-disk artifact (`artifact`) and its writer (`exporter`).

Deliberately imports nothing: `artifact` is read by a numpy-only emulator that must never pull in
JAX, while `exporter` needs JAX. Import the submodule you need.
"""
