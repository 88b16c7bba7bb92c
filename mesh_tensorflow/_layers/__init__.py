"""Layer families behind the `mtf.layers` facade (one module per family).

Layers build mtf ops and variables only; they look TF initializers up on `tensorflow.compat.v1`
at call time and obtain dense kernels through `mtf.layers.get_dense_kernel_weights`, both of
which tests patch.
"""
