"""Every gin binding of 0.1.21's transformer.utils parses (skip_unknown=False), and so does T5's
operative config; a binding of rewrite_stack_variables reaches the lowering."""

from __future__ import annotations

import gin
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow.transformer import utils  # noqa: F401  (registers the utils configurables)

# Every @gin.configurable of 0.1.21's transformer/utils.py with its parameters, read once from the
# original's source (tpu_estimator_model_fn denylists predict_fn, which `run` passes on).
ORIGINAL_UTILS_BINDINGS = {
    "get_variable_dtype": ("master_dtype", "slice_dtype", "activation_dtype"),
    "separate_vocabularies": ("inputs", "targets"),
    "init_checkpoint_variable_mapping": ("name", "mapping_fn"),
    "should_load_variable": ("name", "filter_fn"),
    "tpu_mesh_shape": ("tpu_topology", "model_parallelism", "ensemble_parallelism"),
    "variable_filter_max_size": ("v", "max_size"),
    "flexible_ckpt_init_mapping": ("ckpt_path", "new_layers", "return_mapping_fn"),
    "tpu_estimator_model_fn": (
        "model_type", "transformer_model", "vocabulary", "model_dir", "use_tpu", "mesh_shape", "layout_rules",
        "batch_size", "sequence_length", "autostack", "keep_checkpoint_max", "save_checkpoints_steps",
        "learning_rate_schedule", "optimizer", "outer_batch_size", "tpu_summaries", "score_in_predict_mode",
        "variable_filter", "init_checkpoint", "init_variable_filter", "ensemble_inputs", "mesh_devices",
        "model_info_file", "hierarchical_tiling_spec", "weight_decay_checkpoint"),
    "decode": ("estimator", "input_fn", "vocabulary", "checkpoint_path"),
    "compute_log_likelihoods": ("estimator", "input_fn", "checkpoint_path"),
    "decode_from_file": ("estimator", "vocabulary", "model_type", "batch_size", "sequence_length",
                         "checkpoint_path", "input_filename", "output_filename", "eos_id", "repeats"),
    "decode_from_dataset": ("estimator", "vocabulary", "model_type", "batch_size", "sequence_length",
                            "checkpoint_path", "infer_dataset_fn", "dataset_split", "decode_output_dir"),
    "clean_decodes": ("ids", "eos_id", "pad_id", "length_axis"),
    "save_scores": ("results", "vocabulary", "scores_filename", "save_example_text"),
    "save_scores_to_tfrecords": ("results", "vocabulary", "scores_filename", "shard_idx", "save_ids_only"),
    "score_with_estimator": ("estimator", "input_fn", "eval_checkpoint_step", "model_dir", "vocabulary",
                             "score_postprocess_fn", "num_examples"),
    "score_with_estimator_lazy": ("estimator", "input_fn", "eval_checkpoint_step", "model_dir", "vocabulary",
                                  "score_postprocess_fn", "num_examples", "num_examples_per_shard"),
    "score_from_strings": ("estimator", "vocabulary", "model_type", "batch_size", "sequence_length",
                           "model_dir",
                           "eval_checkpoint_step", "inputs", "targets", "score_postprocess_fn", "eos_id",
                           "score_eos", "score_with_estimator_fn"),
    "score_from_dataset": ("estimator", "vocabulary", "batch_size", "sequence_length", "model_dir",
                           "eval_checkpoint_step", "dataset_split", "score_dataset_fn",
                           "score_postprocess_fn",
                           "score_with_estimator_fn"),
    "infer_model": ("estimator", "vocabulary", "sequence_length", "batch_size", "model_type", "model_dir",
                    "eval_checkpoint_step", "checkpoint_paths", "decode_fn"),
    "serialize_num_microbatches": ("batch_dim", "sequence_length", "mesh_shape", "layout_rules",
                                   "tokens_per_microbatch_per_replica"),
    "auto_train_steps": ("batch_size", "sequence_length", "train_tokens"),
    "get_checkpoint_iterator": ("checkpoint_step", "model_dir", "skip_until", "stop_after", "find_closest"),
    "run": ("tpu_job_name", "tpu", "gcp_project", "tpu_zone", "model_dir", "model_type", "vocabulary",
            "train_dataset_fn", "eval_dataset_fn", "dataset_split", "autostack", "eval_checkpoint_step",
            "export_checkpoint_step", "export_path", "mode", "iterations_per_loop", "save_checkpoints_steps",
            "keep_checkpoint_max", "eval_summary_dir", "batch_size", "train_steps", "total_run_steps",
            "sequence_length", "mesh_shape", "mesh_devices", "layout_rules", "learning_rate_schedule",
            "optimizer",
            "predict_fn", "variable_filter", "perplexity_eval_steps", "init_checkpoint", "ensemble_inputs",
            "train_model_fn", "skip_seen_data", "seen_data_init_step", "output_eval_examples",
            "checkpoint_input_pipeline", "eval_dir_suffix"),
}

# Lines of the operative config T5 writes next to its checkpoints that name the pieces above.
T5_OPERATIVE_CONFIG = """
rewrite_stack_variables.max_combined_variable_size = 536870912
tpu_estimator_model_fn.hierarchical_tiling_spec = None
tpu_estimator_model_fn.init_variable_filter = ''
tpu_estimator_model_fn.model_info_file = ''
tpu_estimator_model_fn.outer_batch_size = 1
tpu_estimator_model_fn.tpu_summaries = False
utils.tpu_mesh_shape.ensemble_parallelism = None
utils.get_variable_dtype.activation_dtype = 'bfloat16'
"""


@pytest.fixture(autouse=True)
def clear_gin():
  gin.clear_config()
  yield
  gin.clear_config()


@pytest.mark.parametrize("name", sorted(ORIGINAL_UTILS_BINDINGS))
def test_every_binding_of_the_originals_utils_parses(name):
  for spelled in (f"utils.{name}", f"mesh_tensorflow.transformer.utils.{name}"):
    gin.parse_config([f"{spelled}.{parameter} = None" for parameter in ORIGINAL_UTILS_BINDINGS[name]],
                     skip_unknown=False)
    for parameter in ORIGINAL_UTILS_BINDINGS[name]:
      assert gin.query_parameter(f"{spelled}.{parameter}") is None
    gin.clear_config()


def test_a_misspelled_parameter_is_still_refused():
  with pytest.raises(ValueError, match="eos_idx"):
    gin.parse_config(["utils.decode_from_file.eos_idx = 1"], skip_unknown=False)


def test_t5s_operative_config_parses():
  gin.parse_config(T5_OPERATIVE_CONFIG, skip_unknown=False)
  assert gin.query_parameter("rewrite_stack_variables.max_combined_variable_size") == 536870912
  assert gin.query_parameter("tpu_estimator_model_fn.outer_batch_size") == 1


def _stacked_variable_count(max_combined_variable_size: int) -> int:
  """How many variables a graph of four [4, 4] variables on a 2-processor mesh has after autostacking."""
  with gin.unlock_config():
    gin.bind_parameter("rewrite_stack_variables.max_combined_variable_size", max_combined_variable_size)
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    dims = [mtf.Dimension("a", 4), mtf.Dimension("b", 4)]
    for i in range(4):
      mtf.get_variable(mesh, f"v{i}", dims, initializer=tf.zeros_initializer())
    impl = mtf.placement_mesh_impl.PlacementMeshImpl("all:2", "a:all", ["", ""])
    graph.rewrite_stack_variables(mesh_to_impl={mesh: impl})
    return len(graph.all_variables)


def test_the_rewrite_stack_variables_binding_limits_the_stacks():
  assert _stacked_variable_count(2 ** 29) == 1  # all four in one stack
  assert _stacked_variable_count(32) == 2  # 16 elements each: two per stack
