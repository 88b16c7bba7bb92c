"""Layer families behind the `mtf.layers` facade (one module per family).

Layers build mtf ops and variables only; they look TF initializers up on `tensorflow.compat.v1`
at call time and obtain dense kernels through `dense.get_dense_kernel_weights`, looked up in
that module at call time; tests patch both (`mtf.layers` passes a patch of its
`get_dense_kernel_weights` on to `dense`).
"""
