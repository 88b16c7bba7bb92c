"""TensorFlow internals mtf needs, in one place: each entry says why the public API does not serve.

Everything under `tensorflow.python` is TensorFlow's private code and may move in any release.
The rest of the package imports such modules only from here (tests/core/test_tf_compat.py keeps
it so), as in `from mesh_tensorflow._tf_compat import resource_variable_ops`, and each is imported
on first use. When a TensorFlow upgrade breaks one, the error names the entry: find where the
module went (or the public API that now does the job), fix its line in _ENTRIES, and run the
tests of the modules that use it (listed per entry).
"""

from __future__ import annotations

import importlib

# name: (TensorFlow module, why mtf needs it and no public API serves; who uses it)
_ENTRIES = {
    "context": (
        "tensorflow.python.eager.context",
        "the eager graph-level seed and the seed generator tf.random.set_seed replaces (the public "
        "tf.random.get_seed advances TF's op seeds); the function call options the device program "
        "sets while it builds calls; _lowering/random_stream.py, _backends/device_program.py"),
    "atomic_function": (
        "tensorflow.python.eager.polymorphic_function.atomic_function",
        "a TF function from a FuncGraph built by hand, called once per device with per-call "
        "attributes (_noinline, _XlaMustCompile); tf.function traces Python, not graphs; "
        "_backends/device_program.py"),
    "func_graph": (
        "tensorflow.python.framework.func_graph",
        "the FuncGraph the device program traces slicewise computations into; "
        "_backends/device_program.py"),
    "resource_variable_ops": (
        "tensorflow.python.ops.resource_variable_ops",
        "telling resource variables from ref variables (BaseResourceVariable) and creating one "
        "whose initial value is set later (UninitializedVariable); _lowering/laid_out.py, "
        "_backends/placement.py"),
    "saveable_object": (
        "tensorflow.python.training.saving.saveable_object",
        "SaveableObject/SaveSpec for bfloat16 parts saved as float32 (CastPart): Saver takes no "
        "public saveable type; _backends/sliced_variables.py"),
    "saveable_object_util": (
        "tensorflow.python.training.saving.saveable_object_util",
        "the saveables Saver makes of a variable, to wrap them; _backends/sliced_variables.py"),
    "control_flow_util": (
        "tensorflow.python.ops.control_flow_util",
        "whether an op is in a while loop, and switching control flow v2 off while the TPU loop is "
        "built; _optimize/step.py, transformer/_train/tpu.py"),
    "util_port": (
        "tensorflow.python.util._pywrap_util_port",
        "whether TF's CPU kernels are oneDNN's (IsMklEnabled), as TF itself decides it; "
        "_backends/cpu_contraction.py"),
    "tpu_ops": (
        "tensorflow.python.tpu.ops.tpu_ops",
        "cross_replica_sum, all_to_all, collective_permute inside a TPU computation (tf.raw_ops "
        "names them but not their shape inference helpers); _backends/simd.py"),
    "tpu_feed": (
        "tensorflow.python.tpu.tpu_feed",
        "InfeedQueue for the on-device training loop (TPUEstimator's, gone from TF 2.16); "
        "transformer/_train/tpu.py"),
    "tpu_training_loop": (
        "tensorflow.python.tpu.training_loop",
        "the on-device while loop of TPU training (TPUEstimator's); transformer/_train/tpu.py"),
    "session": (
        "tensorflow.python.client.session",
        "fetching a TPU replicated variable with Session.run "
        "(register_session_run_conversion_functions has no public name); tpu_variables.py"),
    "ops": (
        "tensorflow.python.framework.ops",
        "convert_to_tensor(..., as_ref=True) for a TPU replicated variable (the public one has no "
        "as_ref); tpu_variables.py"),
    "tensor_conversion_registry": (
        "tensorflow.python.framework.tensor_conversion_registry",
        "tf.convert_to_tensor of a TPU replicated variable (moved out of ops in TF 2.16); "
        "tpu_variables.py"),
    "control_flow_ops": (
        "tensorflow.python.ops.control_flow_ops",
        "XLAControlFlowContext, to find the enclosing TPU replicate context; tpu_variables.py"),
    "gen_resource_variable_ops": (
        "tensorflow.python.ops.gen_resource_variable_ops",
        "the resource variable kernels TPU replicated variables read and assign with, as positional "
        "functions (tf.raw_ops names them too, keyword-only); tpu_variables.py"),
}

__all__ = sorted(_ENTRIES)


def __getattr__(name: str):
  """Imports entry `name` on first use (a clear ImportError if this TensorFlow lacks it)."""
  if name not in _ENTRIES:
    raise AttributeError(f"mesh_tensorflow._tf_compat has no entry {name!r}; add it to _ENTRIES.")
  module, why = _ENTRIES[name]
  try:
    value = importlib.import_module(module)
  except ImportError as e:
    import tensorflow as tf
    raise ImportError(
        f"mesh_tensorflow needs TensorFlow's internal module {module} ({why}), which TensorFlow "
        f"{tf.__version__} lacks. Update the entry {name!r} of mesh_tensorflow/_tf_compat.py.") from e
  globals()[name] = value
  return value
