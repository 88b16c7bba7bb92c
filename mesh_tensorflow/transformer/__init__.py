"""mesh_tensorflow.transformer: Transformer models (layers, stacks, encoder-decoder) built from mtf ops."""
