"""`mtf.optimize`: optimizers that turn mtf gradients into variable updates (a facade over `_optimize`).

Usage: `update_ops = mtf.optimize.AdafactorOptimizer().apply_grads(grads, graph.trainable_variables)`,
then lower the graph and run `[lowering.lowered_operation(op) for op in update_ops]` (plus a
global-step increment) as the train op.

Optimizer state lives in slot variables (checkpoint-visible names: `<var>_momentum_v`,
`<var>/adam_m`, `<var>/adam_v`, `<var>_slot_v`, `<var>_slot_vr`, `<var>_slot_vc`, `<var>_slot_m`)
created with `mtf.get_variable` in the current variable scope. Slots carry their variable's
dimensions (Adafactor's vr/vc drop one), so the layout rules that split a weight split its
optimizer state the same way: e.g. with layout "hidden:cols" on a 4-way `cols` mesh axis, each
processor holds a quarter of the weight and a quarter of its Adam moments. All step-dependent
values (default learning rates, decay rates) read `tf.train.get_or_create_global_step()`.
"""

from mesh_tensorflow._optimize.base import (
    Optimizer as Optimizer, SgdOptimizer as SgdOptimizer, MomentumOptimizer as MomentumOptimizer,
    reduce_rms as reduce_rms)
from mesh_tensorflow._optimize.adam import (
    AdamWeightDecayOptimizer as AdamWeightDecayOptimizer,
    AdamWithMultiLRSchedule as AdamWithMultiLRSchedule)
from mesh_tensorflow._optimize.adafactor import (
    AdafactorOptimizer as AdafactorOptimizer,
    AdafactorWithMultiLRSchedule as AdafactorWithMultiLRSchedule,
    adafactor_optimizer_from_hparams as adafactor_optimizer_from_hparams,
    make_optimizer as make_optimizer)
from mesh_tensorflow._optimize.schedules import (
    adafactor_decay_rate_adam as adafactor_decay_rate_adam,
    adafactor_decay_rate_pow as adafactor_decay_rate_pow,
    product_learning_rate as product_learning_rate,
    compute_lr_for_step as compute_lr_for_step)
