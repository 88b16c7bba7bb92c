"""mesh_tensorflow.transformer.utils: gin flags and defaults, model-side helpers, and the training driver.

Gin names: every configurable here is `utils.<name>` (e.g. `utils.tpu_mesh_shape.model_parallelism`,
`utils.run.mode`). The bodies live in `_utils/` (model-side helpers) and `_train/` (the driver).
"""

from __future__ import annotations

from mesh_tensorflow.transformer._train.checkpoints import (
    get_step_from_checkpoint_path as get_step_from_checkpoint_path,
)
from mesh_tensorflow.transformer._train.checkpoint_selection import (
    flexible_ckpt_init_mapping as flexible_ckpt_init_mapping,
    get_checkpoint_iterator as get_checkpoint_iterator,
    init_checkpoint_variable_mapping as init_checkpoint_variable_mapping,
    should_load_variable as should_load_variable,
    variable_filter_max_size as variable_filter_max_size,
)
from mesh_tensorflow.transformer._utils.features import (
    _MODEL_FEATURES as _MODEL_FEATURES,
    _dynamic_text2self as _dynamic_text2self,
    _filter_features as _filter_features,
    _maybe_add_pretokenized_features as _maybe_add_pretokenized_features,
    clean_decodes as clean_decodes,
    encode_delimited_lm as encode_delimited_lm,
    encode_inputs as encode_inputs,
)
from mesh_tensorflow.transformer._utils.gin_config import (
    FLAGS as FLAGS,
    parse_gin_defaults_and_flags as parse_gin_defaults_and_flags,
)
from mesh_tensorflow.transformer._utils.mesh_sizes import (
    auto_train_steps as auto_train_steps,
    compute_batch_size as compute_batch_size,
    get_variable_dtype as get_variable_dtype,
    serialize_num_microbatches as serialize_num_microbatches,
    tpu_mesh_shape as tpu_mesh_shape,
)
from mesh_tensorflow.transformer._utils.metrics import metric_max as metric_max, metric_sum as metric_sum
from mesh_tensorflow.transformer._utils.models import (
    build_model as build_model,
    separate_vocabularies as separate_vocabularies,
)
from mesh_tensorflow.transformer._utils.text_files import (
    get_inputs_from_file as get_inputs_from_file,
    write_lines_to_file as write_lines_to_file,
)
from mesh_tensorflow.transformer.vocabulary import (
    inputs_vocabulary as inputs_vocabulary,
    targets_vocabulary as targets_vocabulary,
)

# ---- The driver (issue 9) and the estimator-era API over it (issue 22). ----
from mesh_tensorflow.transformer._train.checkpoints import (  # noqa: E402
    CheckpointMismatchError as CheckpointMismatchError,
)
from mesh_tensorflow.transformer._train.estimator import (  # noqa: E402
    Estimator as Estimator,
    tpu_estimator_model_fn as tpu_estimator_model_fn,
)
from mesh_tensorflow.transformer._train.estimator_api import (  # noqa: E402
    compute_log_likelihoods as compute_log_likelihoods,
    decode as decode,
    decode_from_dataset as decode_from_dataset,
    decode_from_file as decode_from_file,
    eval_model as eval_model,
    export_model as export_model,
    get_estimator as get_estimator,
    infer_model as infer_model,
    save_scores as save_scores,
    save_scores_to_tfrecords as save_scores_to_tfrecords,
    score_from_dataset as score_from_dataset,
    score_from_strings as score_from_strings,
    score_with_estimator as score_with_estimator,
    score_with_estimator_lazy as score_with_estimator_lazy,
    train_model as train_model,
)
from mesh_tensorflow.transformer._train.loop import ModelRunner as ModelRunner  # noqa: E402
from mesh_tensorflow.transformer._train.model_fn import build_model_graph as build_model_graph  # noqa: E402
from mesh_tensorflow.transformer._train.run import run as run  # noqa: E402
