"""Training steps whose loss, gradient norm or learning rate is not finite.

By default the loop checks every step's loss and learning rate (fetched anyway, so free) and stops
at the first one that is not finite, before anything is saved (`NonFiniteStepError` names the step
and the last good checkpoint); a non-finite gradient shows in the next step's loss, and the save
refuses variables holding one (checkpoints.NonFiniteCheckpointError). With `non_finite_steps.skip
= True` (gin) the step also computes the global gradient norm (a sum of squares per gradient: one
all-reduce per variable, measured 30% more step time on the 8-CPU mesh of a d_model 128 model) and
gates its updates on all three being finite: such a step changes no variable, is counted and
recorded in TensorBoard (`skipped_steps`), and the run stops after `max_skipped_in_a_row` of them
in a row, as mixed-precision users expect.
"""

from __future__ import annotations

from typing import Optional

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer._train import progress
from mesh_tensorflow.transformer._train.skip_policy import SkipPolicy, skip_policy
from mesh_tensorflow.transformer._utils import GIN_MODULE

SKIPPED_TAG = "skipped_steps"  # TensorBoard scalar: how many steps this run has skipped so far


class NonFiniteStepError(RuntimeError):
  """A training step's loss, gradient norm or learning rate is not finite."""


@gin.configurable("non_finite_steps", module=GIN_MODULE)
def non_finite_policy(skip: bool = False, max_skipped_in_a_row: int = 10) -> SkipPolicy:
  """What the loop does at a non-finite step: stop (default), or skip it (no update)."""
  return skip_policy("non_finite_steps", "non-finite steps", skip, max_skipped_in_a_row)


def gradient_norm(grads) -> mtf.Tensor:
  """The global L2 norm of the gradients (None entries ignored), a float32 mtf scalar."""
  squares = [mtf.reduce_sum(mtf.square(mtf.cast(g, tf.float32))) for g in grads if g is not None]
  return mtf.sqrt(mtf.add_n(squares))


def all_finite(values) -> mtf.Tensor:
  """A bool mtf scalar: every float32 mtf scalar in values is finite (x - x is 0 only then)."""
  total = mtf.add_n(list(values))
  return mtf.equal(total - total, mtf.zeros_like(total))


def _select(condition: mtf.Tensor, if_true: mtf.Tensor, if_false: mtf.Tensor) -> mtf.Tensor:
  """tf.where slice by slice (mtf.where multiplies, and 0 * nan is nan)."""
  return mtf.slicewise(lambda c, a, b: tf.where(c, a, tf.cast(b, a.dtype)), [condition, if_true, if_false],
                       output_shape=if_true.shape, output_dtype=if_true.dtype,
                       splittable_dims=if_true.shape.dims)


def gate_updates(update_ops, finite: mtf.Tensor) -> list:
  """update_ops (mtf Assign operations) rebuilt to change nothing where `finite` is false.

  An assignment keeps the variable's value; an increment adds zero.
  """
  gated = []
  for op in update_ops:
    unchanged = [var.outputs[0] if op.assign_fn is mtf.assign_slice else mtf.zeros_like(value)
                 for var, value in zip(op.variables, op.inputs)]
    values = [_select(finite, value, keep) for value, keep in zip(op.inputs, unchanged)]
    gated.append(mtf.Assign(op.variables, values, assign_fn=op.assign_fn, name=op.name + "_if_finite"))
  return gated


class NonFiniteWatch:
  """Checks each step's values in the loop; counts skipped steps and says when to stop."""

  def __init__(self, policy: SkipPolicy, writer, print_fn):
    self._policy = policy
    self._writer = writer
    self._print = print_fn
    self.skipped = 0
    self._in_a_row = 0

  def check(self, step: int, loss: float, norm: Optional[float], learning_rate: Optional[float],
            latest) -> bool:
    """Whether step (just run) was finite; raises NonFiniteStepError when the run must stop.

    norm None: not computed (skipping is off); learning_rate None: the optimizer's default.
    """
    values = {"loss": loss}
    if norm is not None:
      values["gradient norm"] = norm
    if learning_rate is not None:
      values["learning rate"] = learning_rate
    if all(map(_is_finite, values.values())):
      self._in_a_row = 0
      return True
    what = ", ".join(f"{k} {v:.4g}" for k, v in values.items())
    last_good = f"the last good checkpoint is {latest}" if latest else "no checkpoint was saved yet"
    if not self._policy.skip:
      raise NonFiniteStepError(
          f"Step {step} is not finite ({what}): stopped before saving anything of it; {last_good}. "
          f"Lower the learning rate, or set non_finite_steps.skip = True (gin) to skip such steps.")
    self.skipped += 1
    self._in_a_row += 1
    if self._writer is not None:
      progress.write_scalars(self._writer, step, {SKIPPED_TAG: self.skipped})
    self._print(f"Skipped step {step} ({what}): no variable changed; {self.skipped} skipped so far.")
    if self._in_a_row >= self._policy.max_skipped_in_a_row:
      raise NonFiniteStepError(
          f"Steps {step - self._in_a_row + 1} to {step} were all not finite "
          f"({self._in_a_row} in a row = non_finite_steps.max_skipped_in_a_row): stopped; {last_good}. "
          f"Lower the learning rate or look at the data of these steps.")
    return False


def _is_finite(value: float) -> bool:
  return value - value == 0
