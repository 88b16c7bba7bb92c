"""Import shim for the ORIGINAL mesh_tensorflow 0.1.21 under TensorFlow 2.21 (test-only).

Python imports `sitecustomize` at start-up from the path, and this folder is on PYTHONPATH only
in the subprocesses that run the original (tests/differential/sides.py) or the original's own
test files against our package (test_upstream_suite.py). TF 2.21 no longer has
`tensorflow.compat.v1.estimator` (removed in TF 2.16) nor `tensorflow.python.tpu.tpu_estimator` /
`tpu_config`; the original imports them at module level, and gin.tf reads `tensorflow.estimator`.
This shim supplies modules under those names that hold what the original touches at import time
or off-TPU (`ModeKeys`, the hook and listener base classes, which TF still has under
`tf.compat.v1.train`); the estimator classes themselves raise if used, because no estimator
exists to run them. It also puts back
`ops.register_tensor_conversion_function`, which TF moved to `tensor_conversion_registry`.
"""

import sys
import types

import tensorflow
import tensorflow.compat.v1 as tf
from tensorflow.python.framework import ops, tensor_conversion_registry


class ModeKeys:
  """The mode strings of tf.estimator.ModeKeys, as the original compares them."""
  TRAIN = "train"
  EVAL = "eval"
  PREDICT = "infer"


def _removed(name: str) -> type:
  """A class standing in for an estimator-only class: building one raises, naming it."""

  def refuse(self, *args, **kwargs):
    raise NotImplementedError(
        f"{name} was removed with tf.estimator (TensorFlow 2.16); the differential tests' import "
        "shim only lets the original's modules import, it cannot run an estimator")

  return type(name.rsplit(".", 1)[-1], (), {"__init__": refuse})


def _module(name: str, **attributes) -> types.ModuleType:
  module = types.ModuleType(name)
  module.__dict__.update(attributes)
  sys.modules[name] = module
  return module


_TPU_NAMES = ("TPUEstimator", "TPUEstimatorSpec", "RunConfig", "TPUConfig", "InputPipelineConfig")

_estimator = _module(
    "tensorflow.compat.v1.estimator",
    ModeKeys=ModeKeys,
    SessionRunHook=tf.train.SessionRunHook,
    CheckpointSaverListener=tf.train.CheckpointSaverListener,
    EstimatorSpec=_removed("tf.estimator.EstimatorSpec"),
    Estimator=_removed("tf.estimator.Estimator"),
    export=_module("tensorflow.compat.v1.estimator.export",
                   ServingInputReceiver=_removed("tf.estimator.export.ServingInputReceiver")),
    tpu=_module("tensorflow.compat.v1.estimator.tpu",
                **{n: _removed(f"tf.estimator.tpu.{n}") for n in _TPU_NAMES}))
# gin.tf (imported by the original's transformer.utils) subclasses tf.estimator.SessionRunHook.
tensorflow.estimator = tf.estimator = _estimator
_module("tensorflow.python.tpu.tpu_estimator",
        TPUEstimator=_removed("tpu_estimator.TPUEstimator"),
        TPUEstimatorSpec=_removed("tpu_estimator.TPUEstimatorSpec"))
_module("tensorflow.python.tpu.tpu_config",
        **{n: _removed(f"tpu_config.{n}") for n in ("RunConfig", "TPUConfig", "InputPipelineConfig")})

# TF 2.21 keeps this function only in tensor_conversion_registry; tpu_variables.py calls it through
# ops at import time.
if not hasattr(ops, "register_tensor_conversion_function"):
  ops.register_tensor_conversion_function = tensor_conversion_registry.register_tensor_conversion_function
