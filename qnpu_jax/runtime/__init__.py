"""Running an exported integer model: the engine interface (`interface`), the numpy NPU emulator
(`emulator`), the JAX integer engine (`jax_engine`), `open_engine` (`engines`), decoding and
test-time scaling (`decode`), and the ONNX QDQ graph on onnxruntime (`onnx_run`).

Import the submodule you need: `emulator` never pulls in JAX."""
