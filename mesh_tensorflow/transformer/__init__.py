"""mesh_tensorflow.transformer: Transformer models (layers, stacks, encoder-decoder) built from mtf ops.

Importing the package needs only numpy, absl, gin and TensorFlow: tensorflow_datasets and the other
optional packages are imported by the functions that need them.
"""

from mesh_tensorflow.transformer import (
    attention as attention,
    dataset as dataset,
    evolved_transformer as evolved_transformer,
    fixup_layers as fixup_layers,
    heterogeneous_moe as heterogeneous_moe,
    learning_rate_schedules as learning_rate_schedules,
    moe as moe,
    t2t_vocabulary as t2t_vocabulary,
    transformer as transformer,
    transformer_layers as transformer_layers,
    universal_transformer as universal_transformer,
    utils as utils,
    vocabulary as vocabulary,
)
