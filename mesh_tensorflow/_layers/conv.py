"""Convolution layers: 1-D (via 2-D), separable 1-D, 2-D/3-D, transposed, and spatially blocked.

Filter variables are named `kernel` with spatial dims `fd`, `fh`, `fw`; shapes are
[(fd,) fh, fw, in, out] ([..., out, in] for transposed convolutions). Inputs are channels-last
with any number of leading batch dims.

Blocked ("_with_blocks") variants take an image cut into blocks, [batch, blocks dims..., spatial
dims..., channels]; the blocks dims may be split across processors. Neighbouring blocks' edges
are fetched with a halo exchange (zeros beyond the image), so the result equals the unblocked
"SAME" convolution of the whole image.
"""

from __future__ import annotations

from typing import Optional

import tensorflow.compat.v1 as tf

from mesh_tensorflow import ops_with_redefined_builtins as mtf
from mesh_tensorflow._layers import dense as dense_layers

__all__ = [
    "conv1d", "separable_conv1d", "conv2d", "conv2d_with_blocks", "conv2d_transpose",
    "conv2d_transpose_with_blocks", "conv3d", "conv3d_with_blocks", "conv3d_transpose",
    "conv3d_transpose_with_blocks",
]

_FILTER_DIM_NAMES = {2: ("fh", "fw"), 3: ("fd", "fh", "fw")}


class BlockedConvPaddingError(ValueError, NotImplementedError):
  """A blocked convolution was asked for padding other than "SAME" (upstream raised NotImplementedError)."""
_OPERATIONS = {(2, False): "Conv2dOperation", (3, False): "Conv3dOperation",
               (2, True): "Conv2dTransposeOperation", (3, True): "Conv3dTransposeOperation"}


def _check_sizes(layer: str, what: str, values, conv_dimension: int) -> tuple:
  values = tuple(values)
  if len(values) != conv_dimension or not all(isinstance(v, int) and v > 0 for v in values):
    raise ValueError(f"{layer}: {what}={values} must be {conv_dimension} positive ints, one per "
                     f"spatial dim.")
  return values


def _conv(x: mtf.Tensor, output_dim, filter_size, strides, padding: str, filter_initializer,
          variable_dtype, name: Optional[str], conv_dimension: int, is_transpose: bool) -> mtf.Tensor:
  """Creates the `kernel` variable in scope `name` (default: the layer name) and convolves."""
  layer = "conv%dd%s" % (conv_dimension, "_transpose" if is_transpose else "")
  filter_size = _check_sizes(layer, "filter_size", filter_size, conv_dimension)
  strides = _check_sizes(layer, "strides", strides, conv_dimension)
  filter_dims = [mtf.Dimension(n, s) for n, s in zip(_FILTER_DIM_NAMES[conv_dimension], filter_size)]
  input_dim = x.shape.dims[-1]
  channel_dims = [output_dim, input_dim] if is_transpose else [input_dim, output_dim]
  with tf.variable_scope(name, default_name=layer):
    if variable_dtype is None:
      variable_dtype = mtf.VariableDType(activation_dtype=x.dtype)
    conv_filter = mtf.get_variable(x.mesh, "kernel", mtf.Shape(filter_dims + channel_dims),
                                   initializer=filter_initializer, dtype=variable_dtype)
    operation = getattr(mtf, _OPERATIONS[(conv_dimension, is_transpose)])
    return operation(x, conv_filter, [1, *strides, 1], padding).outputs[0]


def conv2d(x: mtf.Tensor, output_dim, filter_size=(3, 3), strides=(1, 1), padding: str = "SAME",
           filter_initializer=None, variable_dtype=None, name: Optional[str] = None) -> mtf.Tensor:
  """2-D convolution of x [batch..., h, w, in] with a `kernel` [fh, fw, in, out] (no bias).

  variable_dtype defaults to float32 masters/slices with x's dtype as activation dtype.
  """
  return _conv(x, output_dim, filter_size, strides, padding, filter_initializer, variable_dtype, name,
               conv_dimension=2, is_transpose=False)


def conv2d_transpose(x: mtf.Tensor, output_dim, filter_size=(2, 2), strides=(2, 2), padding: str = "SAME",
                     filter_initializer=None, variable_dtype=None, name: Optional[str] = None) -> mtf.Tensor:
  """Transposed 2-D convolution (upsampling by `strides`); `kernel` is [fh, fw, out, in]."""
  return _conv(x, output_dim, filter_size, strides, padding, filter_initializer, variable_dtype, name,
               conv_dimension=2, is_transpose=True)


def conv3d(x: mtf.Tensor, output_dim, filter_size=(3, 3, 3), strides=(1, 1, 1), padding: str = "SAME",
           filter_initializer=None, variable_dtype=None, name: Optional[str] = None) -> mtf.Tensor:
  """3-D convolution of x [batch..., d, h, w, in] with a `kernel` [fd, fh, fw, in, out] (no bias)."""
  return _conv(x, output_dim, filter_size, strides, padding, filter_initializer, variable_dtype, name,
               conv_dimension=3, is_transpose=False)


def conv3d_transpose(x: mtf.Tensor, output_dim, filter_size=(2, 2, 2), strides=(2, 2, 2),
                     padding: str = "SAME", filter_initializer=None, variable_dtype=None,
                     name: Optional[str] = None) -> mtf.Tensor:
  """Transposed 3-D convolution (upsampling by `strides`); `kernel` is [fd, fh, fw, out, in]."""
  return _conv(x, output_dim, filter_size, strides, padding, filter_initializer, variable_dtype, name,
               conv_dimension=3, is_transpose=True)


def conv1d(x: mtf.Tensor, output_dim, filter_size: int = 3, stride: int = 1, **kw_args) -> mtf.Tensor:
  """1-D convolution of x [batch..., length, in] -> [batch..., length', out] via conv2d.

  A size-1 `fake_height` dim is inserted before the length dim, so the `kernel` variable has
  shape [fh=1, fw=filter_size, in, out]. `kw_args` (padding, filter_initializer,
  variable_dtype, name) go to conv2d; the default scope is `conv2d`.
  """
  fake_height = mtf.Dimension("fake_height", 1)
  dims = x.shape.dims
  x = mtf.reshape(x, mtf.Shape(dims[:-2] + [fake_height] + dims[-2:]))
  y = conv2d(x, output_dim, filter_size=(1, filter_size), strides=(1, stride), **kw_args)
  return mtf.reshape(y, y.shape - fake_height)


def separable_conv1d(x: mtf.Tensor, output_dim, min_relative_pos: int = -1, max_relative_pos: int = 1,
                     depthwise_filter_initializer_scale: float = 1.0,
                     pointwise_filter_initializer_scale: float = 1.0, name: Optional[str] = None,
                     use_bias: bool = True, kernel_depth_weights=None) -> mtf.Tensor:
  """Depthwise-separable 1-D convolution of x [batch..., length, depth] -> [batch..., length, out].

  Depthwise part: for each relative position r in [min_relative_pos, max_relative_pos] (index
  i), x shifted by -r along length (zero fill) times a per-depth kernel `depthwise_dense_<i>`
  [depth] (bias on i == 0 only), all summed; the kernels' initializer has variance
  depthwise_filter_initializer_scale / the filter size. Pointwise part: dense `pointwise_dense` [depth, out].
  Scopes: `<name or separable_conv1d>/depthwise_conv_hack/depthwise_dense_<i>` and
  `<name or separable_conv1d>/pointwise_dense`. `kernel_depth_weights`, if given, is one [depth]
  kernel Tensor per relative position (then no depthwise kernel variables are made).
  """
  depth_dim, length_dim = x.shape.dims[-1], x.shape.dims[-2]
  relative_positions = range(min_relative_pos, max_relative_pos + 1)
  if kernel_depth_weights is not None and len(kernel_depth_weights) != len(relative_positions):
    raise ValueError(f"separable_conv1d: got {len(kernel_depth_weights)} kernel_depth_weights for "
                     f"{len(relative_positions)} relative positions [{min_relative_pos}, "
                     f"{max_relative_pos}]; pass one [depth] kernel per position.")
  with tf.variable_scope(name, default_name="separable_conv1d"):
    depthwise = []
    with tf.variable_scope("depthwise_conv_hack"):
      for i, relative_pos in enumerate(relative_positions):
        shifted = mtf.shift(x, -relative_pos, length_dim, wrap=False)
        depthwise.append(dense_layers.dense(
            shifted, new_dims=[], reduced_dims=[], expert_dims=[depth_dim], use_bias=use_bias and i == 0,
            kernel_initializer=dense_layers.VarianceScalingInitializer(
                scale=depthwise_filter_initializer_scale / len(relative_positions)),
            kernel_weights=None if kernel_depth_weights is None else kernel_depth_weights[i],
            name="depthwise_dense_%d" % i))
    return dense_layers.dense(
        mtf.add_n(depthwise), new_dims=[output_dim], reduced_dims=[depth_dim], use_bias=use_bias,
        kernel_initializer=dense_layers.VarianceScalingInitializer(
            scale=pointwise_filter_initializer_scale),
        name="pointwise_dense")


def _halo_sizes(filter_size, strides, is_transpose: bool) -> list:
  """Per spatial dim, how many rows each block needs from each neighbour for a SAME conv.

  conv: filter // 2 (odd filters). Transposed conv (output o = s*i + k - pad_before with
  pad_before = max(f - s, 0) // 2): enough inputs i to cover the block's s*size outputs.
  """
  if not is_transpose:
    return [f // 2 for f in filter_size]
  halos = []
  for f, s in zip(filter_size, strides):
    pad_before = max(f - s, 0) // 2
    halos.append(max((f - 1 - pad_before) // s, -(-pad_before // s)))
  return halos


def _conv_with_blocks(x: mtf.Tensor, output_dim, filter_size, strides, padding: str, blocks_dims: list,
                      filter_initializer, variable_dtype, name, conv_dimension: int,
                      is_transpose: bool) -> mtf.Tensor:
  """Halo-exchanges the blocked spatial dims, convolves, and (transposed) trims the halos' output."""
  layer = "conv%dd%s_with_blocks" % (conv_dimension, "_transpose" if is_transpose else "")
  conv_args = (output_dim, filter_size, strides)
  conv_kwargs = dict(filter_initializer=filter_initializer, variable_dtype=variable_dtype, name=name,
                     conv_dimension=conv_dimension, is_transpose=is_transpose)
  if all(d is None for d in blocks_dims):
    return _conv(x, *conv_args, padding, **conv_kwargs)
  filter_size = _check_sizes(layer, "filter_size", filter_size, conv_dimension)
  strides = _check_sizes(layer, "strides", strides, conv_dimension)
  if padding != "SAME":
    raise BlockedConvPaddingError(
        f"{layer}: padding={padding!r} is not supported with blocks dims; use 'SAME'.")
  if not is_transpose and any(f % 2 == 0 for f in filter_size):
    raise ValueError(f"{layer}: filter_size={filter_size} must be odd with blocks dims.")
  if not is_transpose and any(s != 1 for s in strides):
    raise ValueError(f"{layer}: strides={strides} must be 1 with blocks dims.")
  spatial_dims = x.shape.dims[-(conv_dimension + 1):-1]
  halos = _halo_sizes(filter_size, strides, is_transpose)
  # The leading spatial dims (h, w for 2-D; d, h for 3-D) may be blocked. A VALID convolution
  # needs the others zero-padded; a transposed one is SAME on them already.
  blocks_dims = list(blocks_dims) + [None] * (conv_dimension - len(blocks_dims))
  for blocks_dim, block_dim, halo in zip(blocks_dims, spatial_dims, halos):
    if halo == 0:
      continue
    if blocks_dim is not None:
      x = mtf.halo_exchange(x, blocks_dim, block_dim, halo)
    elif not is_transpose:
      x = mtf.pad(x, [halo, halo], block_dim.name)
  if not is_transpose:
    return _conv(x, *conv_args, "VALID", **conv_kwargs)
  y = _conv(x, *conv_args, "SAME", **conv_kwargs)
  for blocks_dim, block_dim, halo, stride in zip(blocks_dims, spatial_dims, halos, strides):
    if blocks_dim is not None and halo:
      y = mtf.slice(y, halo * stride, block_dim.size * stride, block_dim.name)
  return y


def conv2d_with_blocks(x: mtf.Tensor, output_dim, filter_size=(3, 3), strides=(1, 1), padding: str = "SAME",
                       h_blocks_dim=None, w_blocks_dim=None, filter_initializer=None,
                       variable_dtype=None, name: Optional[str] = None) -> mtf.Tensor:
  """conv2d of x [batch, h_blocks, w_blocks, h, w, in] split into blocks (odd filters, SAME, stride 1).

  With both blocks dims None this is conv2d.
  """
  return _conv_with_blocks(x, output_dim, filter_size, strides, padding, [h_blocks_dim, w_blocks_dim],
                           filter_initializer, variable_dtype, name, conv_dimension=2, is_transpose=False)


def conv2d_transpose_with_blocks(x: mtf.Tensor, output_dim, filter_size=(2, 2), strides=(2, 2),
                                 padding: str = "SAME", h_blocks_dim=None, w_blocks_dim=None,
                                 filter_initializer=None, variable_dtype=None,
                                 name: Optional[str] = None) -> mtf.Tensor:
  """conv2d_transpose of x [batch, h_blocks, w_blocks, h, w, in] split into blocks (SAME)."""
  return _conv_with_blocks(x, output_dim, filter_size, strides, padding, [h_blocks_dim, w_blocks_dim],
                           filter_initializer, variable_dtype, name, conv_dimension=2, is_transpose=True)


def conv3d_with_blocks(x: mtf.Tensor, output_dim, filter_size=(3, 3, 3), strides=(1, 1, 1),
                       padding: str = "SAME", d_blocks_dim=None, h_blocks_dim=None,
                       filter_initializer=None, variable_dtype=None,
                       name: Optional[str] = None) -> mtf.Tensor:
  """conv3d of x [batch, d_blocks, h_blocks, d, h, w, in] split into depth/height blocks."""
  return _conv_with_blocks(x, output_dim, filter_size, strides, padding, [d_blocks_dim, h_blocks_dim],
                           filter_initializer, variable_dtype, name, conv_dimension=3, is_transpose=False)


def conv3d_transpose_with_blocks(x: mtf.Tensor, output_dim, filter_size=(2, 2, 2), strides=(2, 2, 2),
                                 padding: str = "SAME", d_blocks_dim=None, h_blocks_dim=None,
                                 filter_initializer=None, variable_dtype=None,
                                 name: Optional[str] = None) -> mtf.Tensor:
  """conv3d_transpose of x [batch, d_blocks, h_blocks, d, h, w, in] split into depth/height blocks."""
  return _conv_with_blocks(x, output_dim, filter_size, strides, padding, [d_blocks_dim, h_blocks_dim],
                           filter_initializer, variable_dtype, name, conv_dimension=3, is_transpose=True)
