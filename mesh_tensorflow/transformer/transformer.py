"""The Transformer models of mesh_tensorflow (public module; gin names `transformer.X`).

Implementation modules: `_context` (ModeKeys, TransformerLayer, Context), `_layer_stack`
(LayerStack, sublayers, make_layer_stack), `_embedding` (VocabEmbedding, positional embeddings,
ensemble reducers), `_targets` (decoder-input helpers), `_unitransformer` (Unitransformer with
decoding) and `_bitransformer` (Bitransformer, StudentTeacher and their gin factories).
"""

from __future__ import annotations

from mesh_tensorflow.transformer._bitransformer import (
    Bitransformer as Bitransformer,
    StudentTeacher as StudentTeacher,
    make_bi_student_teacher as make_bi_student_teacher,
    make_bitransformer as make_bitransformer,
)
from mesh_tensorflow.transformer._context import (
    Context as Context,
    ModeKeys as ModeKeys,
    TransformerLayer as TransformerLayer,
)
from mesh_tensorflow.transformer._embedding import (
    VocabEmbedding as VocabEmbedding,
    get_vocab_embedding_cls as get_vocab_embedding_cls,
    reduce_ensemble_logits as reduce_ensemble_logits,
    reduce_ensemble_logits_mean_logit as reduce_ensemble_logits_mean_logit,
    reduce_ensemble_logits_mean_prob as reduce_ensemble_logits_mean_prob,
    reduce_ensemble_logits_select as reduce_ensemble_logits_select,
    sinusoid_positional_embedding_weights as sinusoid_positional_embedding_weights,
)
from mesh_tensorflow.transformer._layer_stack import (
    LayerStack as LayerStack,
    ReversibleLayerStack as ReversibleLayerStack,
    make_layer_stack as make_layer_stack,
    sublayer_annealed_dropout as sublayer_annealed_dropout,
    sublayer_call_layer as sublayer_call_layer,
    sublayer_clip_activation_gradient as sublayer_clip_activation_gradient,
    sublayer_dropout as sublayer_dropout,
    sublayer_legacy_dropout as sublayer_legacy_dropout,
    sublayer_legacy_final_rms_norm as sublayer_legacy_final_rms_norm,
    sublayer_legacy_rms_norm as sublayer_legacy_rms_norm,
    sublayer_mask_padding as sublayer_mask_padding,
    sublayer_residual as sublayer_residual,
    sublayer_rezero as sublayer_rezero,
    sublayer_rms_norm as sublayer_rms_norm,
    sublayer_rms_norm_subsampled as sublayer_rms_norm_subsampled,
    sublayer_scale_norm as sublayer_scale_norm,
    sublayer_true_layer_norm as sublayer_true_layer_norm,
)
from mesh_tensorflow.transformer._targets import (
    autoregressive_inputs as autoregressive_inputs,
    delimited_lm_inputs_mask as delimited_lm_inputs_mask,
    shift_targets as shift_targets,
)
from mesh_tensorflow.transformer._unitransformer import (
    Unitransformer as Unitransformer,
)
