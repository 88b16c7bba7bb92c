"""The tf.compat.v1 session training loop: restore or initialise, train, report, checkpoint.

Replaces TPUEstimator.train: one `Session.run` per step, a progress line (and TensorBoard
scalars) every `iterations_per_loop` steps, an atomic checkpoint every `save_checkpoints_steps`
steps and at the end. A restarted run resumes from the latest complete checkpoint, at its global
step and data position.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
from typing import Callable, Optional, Sequence

import gin
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer._train import checkpoints, guards, model_fn, nonfinite, progress
from mesh_tensorflow.transformer._train import checkpoint_selection

# The default graph-level seed (utils.run.random_seed): initial weights, dropout masks and
# sampling noise are the same in every run and under every layout, which makes runs comparable
# and resumed runs exact.
DEFAULT_RANDOM_SEED = 0
OPERATIVE_CONFIG = "operative_config.gin"  # in model_dir: the configuration each run used


def set_random_seed(seed: Optional[int]) -> None:
  """The graph-level seed of a graph the driver builds; None leaves it unset (fresh each run)."""
  if seed is not None:
    tf.set_random_seed(seed)


@dataclasses.dataclass
class TrainConfig:
  """Everything `train` needs besides the model and data (the arguments of utils.run)."""
  model_dir: str
  batch_size: int
  train_steps: int
  mesh_shape: object
  layout_rules: object
  mesh_devices: Optional[list] = None
  iterations_per_loop: int = 100
  save_checkpoints_steps: int = 5000
  keep_checkpoint_max: Optional[int] = None
  autostack: bool = True
  learning_rate_schedule: object = None
  optimizer: Optional[Callable] = None
  variable_filter: object = None
  init_checkpoint: Optional[str] = None
  init_variable_filter: str = ""
  seen_data_init_step: int = 0
  random_seed: Optional[int] = DEFAULT_RANDOM_SEED
  outer_batch_size: int = 1  # > 1: the batch as outer_batch x batch (tpu_estimator_model_fn's)


def checkpoint_step(path: str) -> int:
  """The global step stored in a checkpoint."""
  return int(tf.train.load_checkpoint(path).get_tensor("global_step"))


def initialize_and_restore(session, lowering, checkpoint: Optional[str], manager=None,
                           init_checkpoint: Optional[str] = None, print_fn=print,
                           init_variable_filter: str = "") -> None:
  """Initialises all variables, restores masters from `checkpoint` (or warm-starts from
  init_checkpoint: the variables util.should_load_variable keeps whose checkpoint name, mapped
  by utils.init_checkpoint_variable_mapping, matches the regex init_variable_filter if given),
  then copies the masters to the per-device slices."""
  copy_in = lowering.copy_masters_to_slices()
  session.run(tf.global_variables_initializer())
  if checkpoint:
    if manager is not None:
      manager.restore(session, checkpoint)
    else:
      checkpoints.restore_checkpoint(session, checkpoint, _model_variables(),
                                     optimizer_state_may_be_extra=True)
  elif init_checkpoint:
    pattern = re.compile(init_variable_filter) if init_variable_filter else None
    mapping = checkpoint_selection.init_checkpoint_variable_mapping
    found = checkpoints.restore_available(
        session, init_checkpoint, _model_variables(), checkpoint_name=mapping,
        should_load=lambda name: (checkpoint_selection.should_load_variable(name) and
                                  (pattern is None or bool(pattern.search(mapping(name) or "")))))
    print_fn(f"Initialised {len(found)} variables from init_checkpoint {init_checkpoint}.")
  session.run(copy_in)


def _model_variables() -> list:
  return [v for v in tf.global_variables() if v.op.name != "global_step"]


def _learning_rate(schedule, global_step):
  """The schedule's value at the global step (run() has bound its total_train_steps)."""
  return schedule(step=global_step) if callable(schedule) else schedule


def build_training_graph(model, features: dict, config: TrainConfig, variable_dtype,
                         **build_kwargs) -> model_fn.LoweredModel:
  """The train-mode graph of `model` on `features` under config's mesh, optimizer and schedule."""
  global_step = tf.train.get_or_create_global_step()
  mesh_impl = model_fn.make_mesh_impl(config.mesh_shape, config.layout_rules, config.mesh_devices)
  return model_fn.build_model_graph(
      model, features, "train", mesh_impl, variable_dtype, autostack=config.autostack,
      optimizer=config.optimizer, learning_rate=_learning_rate(config.learning_rate_schedule, global_step),
      variable_filter=config.variable_filter, skip_non_finite=nonfinite.non_finite_policy().skip,
      outer_batch_size=config.outer_batch_size, **build_kwargs)


def train_with(build: Callable[[int], model_fn.LoweredModel], config: TrainConfig, print_fn: Callable = print,
               hooks: Sequence = ()) -> dict:
  """The training loop over the graph build(start_step) returns (built in a fresh graph, after
  the seed is set); trains until global step config.train_steps or until its input ends.

  hooks: tf.compat.v1.train.SessionRunHook-style objects (begin, after_create_session,
  before_run / after_run around each step, end), as Estimator.train takes them.
  """
  started = time.time()
  with guarded_model_dir(config.model_dir, print_fn) as (latest, stop):
    done = nothing_to_train(latest, config, print_fn)
    return done or _train(build, config, print_fn, started, latest, stop, list(hooks))


@contextlib.contextmanager
def guarded_model_dir(model_dir: str, print_fn: Callable = print):
  """Yields (latest checkpoint or None, StopRequest) for a training run of model_dir.

  Holds model_dir's lock (a second run is refused), removes what interrupted saves left, says
  which incomplete checkpoints (and, with restore_fallback, unreadable ones) are skipped;
  SIGTERM / SIGINT meanwhile only set the StopRequest (the loop saves a checkpoint and stops),
  and take their usual effect afterwards.
  """
  tf.io.gfile.makedirs(model_dir)
  with guards.model_dir_lock(model_dir), guards.stop_requests() as stop:
    for leftover in checkpoints.remove_partial_saves(model_dir):
      print_fn(f"Removed {leftover}, left by an interrupted checkpoint save.")
    for message in checkpoints.skipped_checkpoints(model_dir):
      print_fn(message)
    yield checkpoints.resume_checkpoint(model_dir, checkpoints.restore_fallback(), print_fn), stop
  if stop.signum is not None:
    stop.resend()


def nothing_to_train(latest: Optional[str], config: TrainConfig, print_fn: Callable) -> Optional[dict]:
  """train's result when the latest checkpoint is already at train_steps, else None."""
  step = checkpoint_step(latest) if latest else 0
  if step < config.train_steps:
    return None
  print_fn(f"{latest} is at step {step} >= train_steps {config.train_steps}: nothing to train.")
  return {"step": step, "loss": None, "first_step_seconds": None}


def report_stop(stop: guards.StopRequest, step: int, start_step: int, latest: Optional[str],
                print_fn: Callable) -> None:
  """Says which signal stopped the run, and what it saved."""
  saved = f"saved {latest}" if step > start_step else f"no step trained, the latest checkpoint is {latest}"
  print_fn(f"Stopped by {stop.name} at step {step}: {saved}. Run the same command again to resume.")


def _run_step(session, fetches, hooks: list):
  """One session.run of fetches, with the hooks' before_run / after_run around it."""
  if not hooks:
    return session.run(fetches), False
  context = tf.train.SessionRunContext(original_args=tf.train.SessionRunArgs(fetches), session=session)
  requests = [hook.before_run(context) for hook in hooks]
  asks = [r is not None and r.fetches is not None for r in requests]  # before_run may return None
  values, extra_values = session.run([fetches, [r.fetches if ask else [] for r, ask in zip(requests, asks)]])
  for hook, value, ask in zip(hooks, extra_values, asks):
    hook.after_run(context, tf.train.SessionRunValues(results=value if ask else None, options=None,
                                                      run_metadata=None))
  return values, context.stop_requested


def _train(build, config: TrainConfig, print_fn, started, latest, stop: guards.StopRequest,
           hooks: list) -> dict:
  start_step = checkpoint_step(latest) if latest else 0
  if latest:
    print_fn(f"Resuming from {latest} at step {start_step}.")
  with tf.Graph().as_default():
    set_random_seed(config.random_seed)
    built = build(start_step)
    manager = checkpoints.CheckpointManager(config.model_dir, tf.global_variables(),
                                            config.keep_checkpoint_max,
                                            before_save=built.lowering.copy_slices_to_masters())
    # The gradient norm is built only when non-finite steps are skipped; [] fetches nothing.
    fetches = [built.train_op, built.outputs["loss"], built.outputs["learning_rate"],
               built.outputs["tokens"], built.outputs.get("gradient_norm", [])]
    for hook in hooks:
      hook.begin()
    with tf.Session(config=model_fn.session_config(config.mesh_devices)) as session:
      initialize_and_restore(session, built.lowering, latest, manager, config.init_checkpoint, print_fn,
                             config.init_variable_filter)
      for hook in hooks:
        hook.after_create_session(session, None)
      writer = progress.summary_writer(config.model_dir)  # only once the checkpoint restored
      reporter = progress.ProgressReporter(writer, start_step, config.train_steps, print_fn)
      watch = nonfinite.NonFiniteWatch(nonfinite.non_finite_policy(), writer, print_fn)
      step, loss, first_step_seconds, input_ended, hook_stop = start_step, None, None, False, False
      while step < config.train_steps and stop.signum is None and not hook_stop:
        try:
          (_, loss, learning_rate, tokens, norm), hook_stop = _run_step(session, fetches, hooks)
        except tf.errors.OutOfRangeError:
          input_ended = True
          print_fn(f"The training input ended at step {step} (before train_steps {config.train_steps}).")
          break
        step += 1
        watch.check(step, float(loss), None if isinstance(norm, list) else float(norm),
                    None if config.learning_rate_schedule is None else float(learning_rate), latest)
        if first_step_seconds is None:
          first_step_seconds = time.time() - started
          print_fn(f"First training step done {first_step_seconds:.1f}s after start "
                   f"(graph construction, lowering and initialisation included).")
          _write_operative_config(config.model_dir)
        reporter.add_tokens(tokens)
        if step % config.iterations_per_loop == 0 or step == config.train_steps:
          reporter.report(step, float(loss), float(learning_rate))
        if (step % config.save_checkpoints_steps == 0 or step == config.train_steps or stop.signum
            or hook_stop):
          latest = manager.save(session, step)
      if (input_ended or hook_stop) and step > start_step and step % config.save_checkpoints_steps:
        latest = manager.save(session, step)
      if stop.signum is not None:
        report_stop(stop, step, start_step, latest, print_fn)
      for hook in hooks:
        hook.end(session)
    writer.close()
  return {"step": step, "loss": None if loss is None else float(loss),
          "first_step_seconds": first_step_seconds, "skipped_steps": watch.skipped}


def _write_operative_config(model_dir: str) -> None:
  """The gin configuration the run actually used (every configurable called so far)."""
  with open(os.path.join(model_dir, OPERATIVE_CONFIG), "w") as f:
    f.write(gin.operative_config_str())


@dataclasses.dataclass
class ModelRunner:
  """A model with its mesh, dtype and batch shape: what eval, scoring and decoding run (it takes
  the place of upstream's estimator argument)."""
  model: object
  mesh_shape: object
  layout_rules: object
  batch_size: int
  sequence_length: dict
  variable_dtype: object
  mesh_devices: Optional[list] = None
  autostack: bool = True
  random_seed: Optional[int] = DEFAULT_RANDOM_SEED


@contextlib.contextmanager
def restored_session(runner: ModelRunner, mode: str, lengths: dict, checkpoint: str):
  """Builds the `mode` ("eval" or "infer") graph fed by int32 placeholders [batch_size, length],
  restores `checkpoint` into it, and yields (session, placeholders, outputs)."""
  with tf.Graph().as_default():
    set_random_seed(runner.random_seed)
    placeholders = {k: tf.placeholder(tf.int32, [runner.batch_size, n], name=k) for k, n in lengths.items()}
    mesh_impl = model_fn.make_mesh_impl(runner.mesh_shape, runner.layout_rules, runner.mesh_devices)
    built = model_fn.build_model_graph(runner.model, placeholders, mode, mesh_impl, runner.variable_dtype,
                                       runner.autostack)
    with tf.Session(config=model_fn.session_config(runner.mesh_devices)) as session:
      initialize_and_restore(session, built.lowering, checkpoint)
      yield session, placeholders, built.outputs
