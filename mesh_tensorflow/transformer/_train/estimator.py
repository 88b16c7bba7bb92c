"""The estimator-era interface over our own session loop: `tpu_estimator_model_fn` and `Estimator`.

0.1.21 drove training, evaluation, decoding, scoring and export through a TPUEstimator built by
`utils.get_estimator`. tf.estimator is gone from TF 2.21; `Estimator` keeps the part of its
interface clients (T5's MtfModel) use -- train / evaluate / predict / export_saved_model /
latest_checkpoint / model_dir / config / params -- and runs it on the driver's machinery: the
training loop (`loop.train_with`: atomic checkpoints, model-dir lock, SIGTERM saves, progress
lines and TensorBoard scalars), checked restores and the TPU loop (`tpu.train`).

The model function keeps upstream's contract, model_fn(features, labels, mode, params), with
mode strings "train", "eval" and "infer" (tf.estimator.ModeKeys' values); it returns an
`EstimatorSpec` that also carries the lowered graph the session loop needs.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import time
import warnings
from typing import Callable, Iterator, Optional

import gin
import tensorflow as tf2  # tf2.data.Dataset: the base class of v1 and v2 datasets
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer._train import checkpoints, id_checks, loop, model_fn, progress
from mesh_tensorflow.transformer._train import tpu as tpu_lib
from mesh_tensorflow.transformer._utils import GIN_MODULE
from mesh_tensorflow.transformer._utils.features import _MODEL_FEATURES, clean_decodes
from mesh_tensorflow.transformer._utils.mesh_sizes import get_variable_dtype
from mesh_tensorflow.transformer._utils.metrics import metric_max, metric_sum


class ModeKeys:
  """tf.estimator.ModeKeys' values (the mode strings model_fn receives)."""
  TRAIN = "train"
  EVAL = "eval"
  PREDICT = "infer"


# What tf.estimator.export.ServingInputReceiver held: the model's features and the tensors a
# SavedModel's signature takes.
ServingInputReceiver = collections.namedtuple("ServingInputReceiver", ["features", "receiver_tensors"])


@dataclasses.dataclass
class EstimatorSpec:
  """What model_fn returns: tf.estimator.EstimatorSpec's fields plus the lowered mesh graph."""
  mode: str
  lowered: model_fn.LoweredModel
  loss: Optional[tf.Tensor] = None
  train_op: Optional[tf.Operation] = None
  predictions: Optional[dict] = None
  eval_metric_ops: Optional[dict] = None


@dataclasses.dataclass
class RunConfig:
  """The part of tf.estimator's (TPU) RunConfig the driver uses."""
  model_dir: str
  save_checkpoints_steps: int = 5000
  keep_checkpoint_max: Optional[int] = None
  iterations_per_loop: int = 100
  tpu_job_name: Optional[str] = None
  cluster: object = None
  tf_random_seed: Optional[int] = loop.DEFAULT_RANDOM_SEED


def _features_for_model(features: dict, batch_size: int, sequence_length: dict) -> dict:
  """The features models read, each reshaped to [batch_size, its length] (static shapes)."""
  shaped = {}
  for key in _MODEL_FEATURES:
    if key in features:
      length = sequence_length[key.split("_")[0]]
      shaped[key] = tf.reshape(tf.cast(features[key], tf.int32), [batch_size, length])
  return shaped


def _eval_metric_ops(outputs: dict) -> dict:
  """Upstream's teacher-forced metrics, as (value, update_op) pairs over the eval batches."""
  xent, predictions = outputs["cross_entropy"], outputs["predictions"]
  labels, weights = outputs["targets"], outputs["weights"]
  token_correct = tf.cast(tf.equal(predictions, labels), tf.float32) * weights
  sequence_correct = tf.cast(tf.equal(tf.reduce_sum(token_correct, -1), tf.reduce_sum(weights, -1)),
                             tf.float32)
  sequence_weights = tf.cast(tf.not_equal(tf.reduce_sum(weights, -1), 0), tf.float32)
  return {"loss": tf.metrics.mean(xent, weights),
          "neg_log_perplexity": tf.metrics.mean(-xent, weights),
          "token_accuracy": tf.metrics.mean(token_correct, weights),
          "sequence_accuracy": tf.metrics.mean(sequence_correct, sequence_weights),
          "mean_label": tf.metrics.mean(tf.cast(labels, tf.float32), weights),
          "num_eval_tokens": metric_sum(weights, name="num_eval_tokens"),
          "max_targets_length": metric_max(tf.reduce_sum(weights, axis=-1), name="max_targets_length")}


class ModelFn:
  """The model function tpu_estimator_model_fn returns; its arguments stay readable as attributes
  (the Estimator takes the mesh, optimizer and checkpoint settings of training from them)."""

  def __init__(self, **arguments):
    self.__dict__.update(arguments)
    self.mesh_shape = mtf.convert_to_shape(self.mesh_shape)
    self.layout_rules = mtf.convert_to_layout_rules(self.layout_rules)
    self.mesh_devices = model_fn.mesh_devices_or_default(self.mesh_shape, self.mesh_devices)
    if isinstance(self.sequence_length, int):
      self.sequence_length = {"inputs": self.sequence_length, "targets": self.sequence_length}

  def mesh_impl(self):
    if self.hierarchical_tiling_spec is not None:
      spec = self.hierarchical_tiling_spec
      warnings.warn(f"tpu_estimator_model_fn.hierarchical_tiling_spec = {spec!r} only maps the mesh onto "
                    f"TPU chips; on CPUs/GPUs it is ignored (it cannot change results, only where slices "
                    f"live).", stacklevel=2)
    return model_fn.make_mesh_impl(self.mesh_shape, self.layout_rules, self.mesh_devices)

  def train_config(self, train_steps: int, iterations_per_loop: int = 100, seen_data_init_step: int = 0,
                   random_seed: Optional[int] = loop.DEFAULT_RANDOM_SEED) -> loop.TrainConfig:
    """The loop's configuration for training to global step train_steps."""
    return loop.TrainConfig(
        model_dir=self.model_dir, batch_size=self.batch_size, train_steps=train_steps,
        mesh_shape=self.mesh_shape, layout_rules=self.layout_rules, mesh_devices=self.mesh_devices,
        iterations_per_loop=iterations_per_loop, save_checkpoints_steps=self.save_checkpoints_steps,
        keep_checkpoint_max=self.keep_checkpoint_max, autostack=self.autostack,
        learning_rate_schedule=self.learning_rate_schedule, optimizer=self.optimizer,
                            variable_filter=self.variable_filter,
        init_checkpoint=self.init_checkpoint, init_variable_filter=self.init_variable_filter or "",
        seen_data_init_step=seen_data_init_step, random_seed=random_seed,
        outer_batch_size=self.outer_batch_size or 1)

  def __call__(self, features: dict, labels, mode: str, params: Optional[dict] = None,
               config=None) -> EstimatorSpec:
    """Builds and lowers the `mode` graph on features ({name: int tensor [batch, length]})."""
    del labels, config
    if mode not in model_fn.MODES:
      raise ValueError(f"model_fn mode {mode!r}: expected one of {model_fn.MODES} (tf.estimator.ModeKeys).")
    if mode == ModeKeys.PREDICT and self.score_in_predict_mode:
      mode = "score"
    features = dict(features)
    predict_batch_size = features.pop("predict_batch_size", None)
    lengths = dict(self.sequence_length)
    unitransformer = model_fn.is_unitransformer(self.transformer_model)
    if mode == ModeKeys.PREDICT and unitransformer and "inputs" in features:
      lengths["inputs"] = lengths["targets"]  # the prompt, then room to continue it
      missing = lengths["targets"] - tf.shape(features["inputs"])[-1]
      features["inputs"] = tf.pad(features["inputs"], [[0, 0], [0, tf.maximum(missing, 0)]])
    features = _features_for_model(features, self.batch_size, lengths)
    self._check_features(features, mode)
    build = dict(autostack=self.autostack, predict_fn=self.predict_fn,
                 outer_batch_size=self.outer_batch_size or 1)
    if mode == ModeKeys.TRAIN:
      config = self.train_config(train_steps=0)
      lowered = loop.build_training_graph(self.transformer_model, features, config, get_variable_dtype(),
                                          log_file=self.model_info_file or None)
      return EstimatorSpec(mode, lowered, loss=lowered.outputs["loss"], train_op=lowered.train_op)
    graph_mode = "infer" if mode == ModeKeys.PREDICT else "eval"
    if mode != ModeKeys.EVAL:
      build["outer_batch_size"] = 1
    lowered = model_fn.build_model_graph(self.transformer_model, features, graph_mode, self.mesh_impl(),
                                         get_variable_dtype(), token_outputs=(mode == ModeKeys.EVAL), **build)
    if mode == ModeKeys.EVAL:
      metrics = _eval_metric_ops(lowered.outputs)
      return EstimatorSpec(mode, lowered, loss=metrics["loss"][0], eval_metric_ops=metrics)
    if mode == "score":
      predictions = {"targets": clean_decodes(features["targets"]),
                     "scores": lowered.outputs["log_likelihood"]}
    else:
      predictions = {"inputs": clean_decodes(features["inputs"]),
                     "outputs": clean_decodes(lowered.outputs["outputs"])}
    if predict_batch_size is not None:
      predictions = {k: v[:predict_batch_size] for k, v in predictions.items()}
    return EstimatorSpec(ModeKeys.PREDICT, lowered, predictions=predictions)

  def _check_features(self, features: dict, mode: str) -> None:
    """Upstream's check that the features fit mode and model_type."""
    if mode == ModeKeys.PREDICT:
      required = {"inputs": True}
    elif mode == "score":
      required = {"targets": True}
    else:
      required = {"targets": True, "inputs": self.model_type != "lm"}
    for name, should_exist in required.items():
      if should_exist != (name in features):
        hint = (" model_type 'delimited_lm' is for tasks with inputs and targets, 'lm' for targets only."
                if "lm" in self.model_type else "")
        should = "should" if should_exist else "should not"
        raise ValueError(f"mode={mode} model_type={self.model_type} {should} have feature {name!r}; "
                         f"the input_fn gave {sorted(features)}.{hint}")


@gin.configurable(module=GIN_MODULE, denylist=["predict_fn"])
def tpu_estimator_model_fn(model_type, transformer_model, vocabulary, model_dir, use_tpu, mesh_shape,
                           layout_rules, batch_size, sequence_length, autostack, keep_checkpoint_max,
                           save_checkpoints_steps, learning_rate_schedule=None, optimizer=None,
                           outer_batch_size=1, tpu_summaries=False, predict_fn=None,
                           score_in_predict_mode=False, variable_filter=None, init_checkpoint=None,
                           init_variable_filter="",
                           ensemble_inputs=None, mesh_devices=None, model_info_file=None,
                           hierarchical_tiling_spec=None, weight_decay_checkpoint=None) -> ModelFn:
  """The model function of the transformer, with upstream's arguments (gin: utils.tpu_estimator_model_fn).

  Args:
    model_type: "bitransformer", "bi_student_teacher", "lm", "delimited_lm" or "aligned".
    transformer_model: a transformer.Unitransformer, Bitransformer or StudentTeacher.
    vocabulary: a vocabulary or (inputs, targets) pair.
    model_dir: where checkpoints go.
    use_tpu: truthy to train on a TPU (the Estimator then runs tpu.train).
    mesh_shape, layout_rules: the mesh and layout (anything mtf.convert_to_* takes).
    batch_size: sequences per batch; sequence_length: an int or {feature: length}.
    autostack: stack variables (mtf.Lowering's autostack).
    keep_checkpoint_max, save_checkpoints_steps: checkpoint retention and frequency.
    learning_rate_schedule: a float, or a function of `step` (total_train_steps already bound).
    optimizer: an optimizer class, called as optimizer(learning_rate=...).
    outer_batch_size: splits the batch into `outer_batch` x `batch` dims (train and eval).
    tpu_summaries: upstream's TPU host-call summaries; our loop writes its scalars from the host
      in every case, so this changes nothing.
    predict_fn: replaces decoding (and scoring): predict_fn(model=, features=, variable_dtype=).
    score_in_predict_mode: "infer" computes log-likelihood scores instead of decodes.
    variable_filter: what trains: None, a regex searched in variable names, or a predicate on
      mtf Variables.
    init_checkpoint: warm start from this checkpoint (variables present in both).
    init_variable_filter: regex; only checkpoint variables matching it are loaded ("" = all).
    ensemble_inputs: not implemented (must be None).
    mesh_devices: one device per processor (default: TF's placement).
    model_info_file: a path for the lowering's log of variable and operation sizes.
    hierarchical_tiling_spec: maps the mesh onto TPU chips (tpu.train); accepted and ignored, with
      a warning, on CPUs/GPUs, where it cannot change results.
    weight_decay_checkpoint: upstream's Google-internal argument; must be None.

  Returns:
    model_fn(features, labels, mode, params=None, config=None) -> EstimatorSpec.
  """
  if ensemble_inputs is not None:
    raise NotImplementedError(f"tpu_estimator_model_fn.ensemble_inputs = {ensemble_inputs!r}: ensemble "
                              f"inputs are not implemented; leave it None.")
  if weight_decay_checkpoint is not None:
    raise NotImplementedError("tpu_estimator_model_fn.weight_decay_checkpoint (Google-internal upstream) is "
                              "not implemented; leave it None.")
  del tpu_summaries  # see Args
  return ModelFn(
      model_type=model_type, transformer_model=transformer_model, vocabulary=vocabulary, model_dir=model_dir,
      use_tpu=use_tpu, mesh_shape=mesh_shape, layout_rules=layout_rules, batch_size=batch_size,
      sequence_length=sequence_length, autostack=autostack, keep_checkpoint_max=keep_checkpoint_max,
      save_checkpoints_steps=save_checkpoints_steps, learning_rate_schedule=learning_rate_schedule,
      optimizer=optimizer, outer_batch_size=outer_batch_size, predict_fn=predict_fn,
      score_in_predict_mode=score_in_predict_mode, variable_filter=variable_filter,
      init_checkpoint=init_checkpoint, init_variable_filter=init_variable_filter, mesh_devices=mesh_devices,
      model_info_file=model_info_file, hierarchical_tiling_spec=hierarchical_tiling_spec)


def _dataset_features(input_fn: Callable, params: dict) -> dict:
  """The next-element tensors of input_fn(params)'s dataset ((features, labels) pairs give features)."""
  dataset = input_fn(params)
  if not isinstance(dataset, tf2.data.Dataset):
    raise TypeError(f"input_fn returned {type(dataset).__name__}; expected a tf.data.Dataset of batched "
                    f"feature dicts.")
  element = tf.data.make_one_shot_iterator(dataset).get_next()
  return element[0] if isinstance(element, tuple) else element


def _feed_dicts(session, element: dict, feeds: dict) -> Iterator[dict]:
  """{placeholder: value} of each next element of the input, until it ends."""
  while True:
    try:
      values = session.run(element)
    except tf.errors.OutOfRangeError:
      return
    except tf.errors.InvalidArgumentError as error:
      bad_ids = id_checks.bad_ids_error(error, session.graph)
      if bad_ids is None:
        raise
      raise bad_ids from None
    yield {feeds[k]: values[k] for k in feeds}


class Estimator:
  """tf.estimator.Estimator's interface over the driver (see the module docstring).

  Args:
    model_fn: a ModelFn (from tpu_estimator_model_fn).
    config: a RunConfig.
    params: extra params for input_fn and model_fn; "batch_size" is set to model_fn.batch_size.
  """

  def __init__(self, model_fn: ModelFn, config: RunConfig, params: Optional[dict] = None):
    self._model_fn = model_fn
    self._config = config
    self._params = dict(params or {}, batch_size=model_fn.batch_size, use_tpu=bool(model_fn.use_tpu))
    self.train_result: Optional[dict] = None

  @property
  def model_dir(self) -> str:
    return self._config.model_dir

  @property
  def config(self) -> RunConfig:
    return self._config

  @property
  def params(self) -> dict:
    return dict(self._params)

  @property
  def model_fn(self) -> ModelFn:
    return self._model_fn

  def runner(self, batch_size: Optional[int] = None,
             sequence_length: Optional[dict] = None) -> loop.ModelRunner:
    """The model with its mesh, dtype and batch shape (for the runner-based eval, decode and export)."""
    fn = self._model_fn
    return loop.ModelRunner(model=fn.transformer_model, mesh_shape=fn.mesh_shape,
                            layout_rules=fn.layout_rules,
                            batch_size=batch_size or fn.batch_size,
                            sequence_length=dict(sequence_length or fn.sequence_length),
                            variable_dtype=get_variable_dtype(), mesh_devices=fn.mesh_devices,
                            autostack=fn.autostack, random_seed=self._config.tf_random_seed)

  def latest_checkpoint(self) -> Optional[str]:
    return checkpoints.latest_checkpoint(self.model_dir)

  def get_variable_value(self, name: str):
    """The value of variable `name` in the latest checkpoint."""
    return tf.train.load_checkpoint(self._checkpoint(None)).get_tensor(name)

  def get_variable_names(self) -> list:
    return [name for name, _ in tf.train.list_variables(self._checkpoint(None))]

  def _checkpoint(self, checkpoint_path: Optional[str]) -> str:
    path = checkpoint_path or self.latest_checkpoint()
    if path is None:
      raise ValueError(f"No checkpoint in {self.model_dir} (the estimator's model_dir): train first or pass "
                       f"checkpoint_path.")
    return path

  def train(self, input_fn: Callable, hooks=None, steps: Optional[int] = None,
            max_steps: Optional[int] = None,
            saving_listeners=None) -> Estimator:
    """Trains on input_fn(params)'s batches until global step max_steps (or `steps` more steps).

    Resumes from the latest checkpoint of model_dir; the loop's result ({"step", "loss",
    "first_step_seconds"}) is kept in `train_result`.
    """
    if saving_listeners:
      raise NotImplementedError("Estimator.train(saving_listeners=...) is not implemented.")
    if (steps is None) == (max_steps is None):
      raise ValueError(f"Estimator.train needs exactly one of steps ({steps!r}) and max_steps "
                       f"({max_steps!r}).")
    latest = self.latest_checkpoint()
    start_step = loop.checkpoint_step(latest) if latest else 0
    train_steps = max_steps if max_steps is not None else start_step + steps
    fn = self._model_fn
    if fn.use_tpu:
      if hooks:
        raise NotImplementedError("Estimator.train(hooks=...) is not implemented on TPUs.")
      # tpu.train batches and skips itself: hand it the examples input_fn's batches hold, and
      # no batches to skip (input_fn decided where the data starts).
      self.train_result = tpu_lib.train(
          fn.transformer_model, lambda: input_fn(self.params).unbatch(),
          self._train_config(train_steps, seen_data_init_step=start_step), get_variable_dtype(),
          cluster=self._config.cluster,
          hierarchical_tiling_spec=fn.hierarchical_tiling_spec or tpu_lib.hierarchical_tiling_spec())
      return self

    def build(start_step: int) -> model_fn.LoweredModel:
      del start_step  # input_fn decides where the data starts
      return fn(_dataset_features(input_fn, self.params), None, ModeKeys.TRAIN, self.params).lowered
    self.train_result = loop.train_with(build, self._train_config(train_steps), hooks=hooks or ())
    return self

  def _train_config(self, train_steps: int, seen_data_init_step: int = 0) -> loop.TrainConfig:
    return self._model_fn.train_config(train_steps, self._config.iterations_per_loop, seen_data_init_step,
                                       self._config.tf_random_seed)

  def _restored(self, input_fn: Callable, mode: str, checkpoint_path: str):
    """Builds the mode graph on input_fn's features; returns (graph, spec, session restored with the
    local variables (metric accumulators) initialised, an iterator of feed dicts of the batches).

    The model reads the batches through placeholders, and each batch is read by a run of the input
    pipeline alone: the end of the input then ends no run of the mesh graph on several devices.
    """
    graph = tf.Graph()
    with graph.as_default():
      loop.set_random_seed(self._config.tf_random_seed)
      element = _dataset_features(input_fn, self.params)
      feeds = {k: tf.placeholder(v.dtype, v.shape) for k, v in element.items()}
      spec = self._model_fn(feeds, None, mode, self.params)
      local_init = tf.local_variables_initializer()  # before any run: the graph is final then
      session = tf.Session(graph=graph, config=model_fn.session_config(self._model_fn.mesh_devices))
      loop.initialize_and_restore(session, spec.lowered.lowering, checkpoint_path)
      session.run(local_init)
    return graph, spec, session, _feed_dicts(session, element, feeds)

  def predict(self, input_fn: Callable, predict_keys=None, hooks=None, checkpoint_path: Optional[str] = None,
              yield_single_examples: bool = True) -> Iterator:
    """Yields the predictions of each example (or each batch) of input_fn's finite dataset.

    Predictions: {"inputs", "outputs"} (token ids, cleaned after EOS) or, with
    score_in_predict_mode, {"targets", "scores"}.
    """
    if hooks:
      raise NotImplementedError("Estimator.predict(hooks=...) is not implemented.")
    path = self._checkpoint(checkpoint_path)
    graph, spec, session, batches = self._restored(input_fn, ModeKeys.PREDICT, path)
    predictions = spec.predictions
    if predict_keys:
      keys = [predict_keys] if isinstance(predict_keys, str) else list(predict_keys)
      predictions = {k: predictions[k] for k in keys}
    with graph.as_default(), session:
      for feed_dict in batches:
        values = session.run(predictions, feed_dict)
        if not yield_single_examples:
          yield values
          continue
        for i in range(len(next(iter(values.values())))):
          yield {k: v[i] for k, v in values.items()}

  def evaluate(self, input_fn: Callable, steps: Optional[int] = None, hooks=None,
               checkpoint_path: Optional[str] = None, name: Optional[str] = None) -> dict:
    """Teacher-forced metrics over `steps` batches of input_fn (all of them if None).

    Returns {metric: value} plus "global_step"; the values go to TensorBoard in
    model_dir/eval (or eval_<name>).
    """
    if hooks:
      raise NotImplementedError("Estimator.evaluate(hooks=...) is not implemented.")
    path = self._checkpoint(checkpoint_path)
    graph, spec, session, batches = self._restored(input_fn, ModeKeys.EVAL, path)
    with graph.as_default(), session:
      updates = [update for _, update in spec.eval_metric_ops.values()]
      for feed_dict in itertools.islice(batches, steps):
        session.run(updates, feed_dict)
      results = {k: float(v) for k, v in session.run({k: value for k, (value, _) in
                                                       spec.eval_metric_ops.items()}).items()}
    step = loop.checkpoint_step(path)
    writer = progress.summary_writer(os.path.join(self.model_dir, "eval" if not name else "eval_" + name))
    progress.write_scalars(writer, step, results)
    writer.close()
    results["global_step"] = step
    return results

  def export_saved_model(self, export_dir_base: str, serving_input_receiver_fn: Callable, assets_extra=None,
                         as_text: bool = False, checkpoint_path: Optional[str] = None,
                         experimental_mode: str = ModeKeys.PREDICT) -> str:
    """A SavedModel of the predict graph on serving_input_receiver_fn()'s features, in
    export_dir_base/<timestamp>; signature serving_default: receiver tensors -> predictions.
    Loading it runs the copy of the master variables to the slices (its main op)."""
    if assets_extra:
      raise NotImplementedError("export_saved_model(assets_extra=...) is not implemented.")
    if experimental_mode != ModeKeys.PREDICT:
      raise NotImplementedError(f"export_saved_model exports the {ModeKeys.PREDICT!r} graph only, not "
                                f"{experimental_mode!r}.")
    path = self._checkpoint(checkpoint_path)
    export_dir = os.path.join(export_dir_base, str(int(time.time())))
    with tf.Graph().as_default():
      loop.set_random_seed(self._config.tf_random_seed)
      receiver = serving_input_receiver_fn()
      spec = self._model_fn(dict(receiver.features), None, ModeKeys.PREDICT, self.params)
      copy_in = spec.lowered.lowering.copy_masters_to_slices()
      with tf.Session(config=model_fn.session_config(self._model_fn.mesh_devices)) as session:
        loop.initialize_and_restore(session, spec.lowered.lowering, path)
        builder = tf.saved_model.Builder(export_dir)
        signature = tf.saved_model.predict_signature_def(receiver.receiver_tensors, spec.predictions)
        builder.add_meta_graph_and_variables(session, [tf.saved_model.SERVING], main_op=copy_in,
                                             signature_def_map={"serving_default": signature},
                                             strip_default_attrs=True)
        builder.save(as_text=as_text)
    return export_dir

