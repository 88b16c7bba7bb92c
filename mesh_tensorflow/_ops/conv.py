"""2-D and 3-D convolutions, their transposes, and the backprop ops that serve as their gradients.

Layout: inputs are channels-last, `[...batch, (d,) h, w, in]`; leading batch dims (any number) are
flattened per slice. Filters are `[(fd,) fh, fw, in, out]` (`[..., out, in]` for transposed convs).
Spatial dims must stay whole on each processor; batch and channel dims may be split. A split `in`
dim leaves partial sums, which are allreduced lazily. Strided output sizes round down, as upstream:
(n or n - f + 1) // stride. To partition an image spatially, give it blocks dims and use
`halo_exchange` followed by a VALID convolution (see docs/spatial_partitioning.md).
"""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow.compat.v1 as tf

from mesh_tensorflow._core.dims import Dimension, Shape, convert_to_shape, list_product
from mesh_tensorflow._core.operation import Operation
from mesh_tensorflow._core.tensor import Tensor

__all__ = [
    "Conv2dOperation", "Conv3dOperation", "Conv2dTransposeOperation", "Conv3dTransposeOperation",
    "Conv2or3dBackpropInputOperation", "Conv2or3dBackpropFilterOperation",
    "conv2d_backprop_input", "conv2d_backprop_filter", "conv3d_backprop_input", "conv3d_backprop_filter",
    "conv2d_transpose_backprop_input", "conv2d_transpose_backprop_filter",
    "conv3d_transpose_backprop_input", "conv3d_transpose_backprop_filter",
    "conv3d_backprop_filter_v2", "conv3d_backprop_input_v2",
]

_SPATIAL_ROLES = {2: ("h", "w"), 3: ("d", "h", "w")}
_PADDINGS = ("SAME", "VALID")
# Per conv dimension: (forward, backprop-to-input, backprop-to-filter) TF kernels.
_TF_KERNELS = {
    2: (tf.raw_ops.Conv2D, tf.raw_ops.Conv2DBackpropInput, tf.raw_ops.Conv2DBackpropFilter),
    3: (tf.raw_ops.Conv3D, tf.raw_ops.Conv3DBackpropInputV2, tf.raw_ops.Conv3DBackpropFilterV2),
}


# ---- per-slice TensorFlow computations (leading batch dims flattened into one) ----
#
# mtf sizes a strided conv's output as (n or n - f + 1) // stride, as upstream did; TensorFlow
# rounds up. Where they differ, the forward pass drops TF's last (partial-window) outputs and
# the backward passes give those positions a zero gradient.

def _flatten_batch_dims(x, conv_dimension: int):
  return tf.reshape(x, [-1] + x.shape.as_list()[-(conv_dimension + 1):])


def _flat_sizes(slice_shape: list, conv_dimension: int) -> list:
  """A per-slice shape with its batch dims multiplied into one."""
  n = conv_dimension + 1
  return [list_product(slice_shape[:-n])] + slice_shape[-n:]


def _tf_conv(conv_dimension, x, conv_filter, strides, padding, out_slice_shape):
  conv_fn = _TF_KERNELS[conv_dimension][0]
  y = conv_fn(input=_flatten_batch_dims(x, conv_dimension), filter=conv_filter, strides=strides,
              padding=padding)
  y = tf.reshape(y, x.shape.as_list()[:-(conv_dimension + 1)] + y.shape.as_list()[1:])
  if y.shape.as_list() == list(out_slice_shape):
    return y
  return tf.slice(y, [0] * len(out_slice_shape), out_slice_shape)


def _pad_dy_to_tf_size(conv_dimension, dy, input_slice_shape, filter_slice_shape, strides, padding):
  """Zero-pads dy's spatial dims up to the size TF's conv of `input_slice_shape` would output."""
  spatial = slice(-(conv_dimension + 1), -1)
  tf_sizes = [_output_size(n, f, s, padding, is_transpose=False, round_up=True) for n, f, s in zip(
      input_slice_shape[spatial], filter_slice_shape[:conv_dimension], strides[1:-1])]
  paddings = [[0, 0]] * dy.shape.ndims
  paddings[spatial] = [[0, want - have] for want, have in zip(tf_sizes, dy.shape.as_list()[spatial])]
  return tf.pad(dy, paddings) if any(after for _, after in paddings) else dy


def _tf_conv_backprop_input(conv_dimension, input_slice_shape, conv_filter, dy, strides, padding):
  backprop_fn = _TF_KERNELS[conv_dimension][1]
  dy = _pad_dy_to_tf_size(conv_dimension, dy, input_slice_shape, conv_filter.shape.as_list(), strides,
                          padding)
  dx = backprop_fn(input_sizes=_flat_sizes(input_slice_shape, conv_dimension), filter=conv_filter,
                   out_backprop=_flatten_batch_dims(dy, conv_dimension), strides=strides, padding=padding)
  return tf.reshape(dx, input_slice_shape)


def _tf_conv_backprop_filter(conv_dimension, x, filter_slice_shape, dy, strides, padding):
  backprop_fn = _TF_KERNELS[conv_dimension][2]
  dy = _pad_dy_to_tf_size(conv_dimension, dy, x.shape.as_list(), filter_slice_shape, strides, padding)
  return backprop_fn(input=_flatten_batch_dims(x, conv_dimension), filter_sizes=filter_slice_shape,
                     out_backprop=_flatten_batch_dims(dy, conv_dimension), strides=strides,
                     padding=padding)


# ---- argument checks ----

def _check_dtypes(op_name: str, tensors) -> None:
  """All floating point and of one dtype."""
  for t in tensors:
    if not t.dtype.is_floating:
      raise ValueError(
          f"{op_name!r}: convolutions need floating-point tensors, but {t.name!r} has dtype "
          f"{t.dtype.name}; cast it first, e.g. mtf.cast(x, tf.float32).")
    if t.dtype != tensors[0].dtype:
      raise ValueError(
          f"{op_name!r}: {t.name!r} has dtype {t.dtype.name} but {tensors[0].name!r} has "
          f"{tensors[0].dtype.name}; cast them to one dtype.")


def _check_ranks(op_name: str, conv_dimension: int, input_shape: Shape, filter_shape: Shape) -> None:
  roles = _SPATIAL_ROLES[conv_dimension]
  if input_shape.ndims < conv_dimension + 1:
    raise ValueError(
        f"{op_name!r}: conv{conv_dimension}d input {input_shape} needs at least {conv_dimension + 1} "
        f"dims [...batch, {', '.join(roles)}, in_channels].")
  if filter_shape.ndims != conv_dimension + 2:
    raise ValueError(
        f"{op_name!r}: conv{conv_dimension}d filter {filter_shape} needs exactly "
        f"{conv_dimension + 2} dims [{', '.join('f' + r for r in roles)}, in, out].")


def _check_padding(op_name: str, padding) -> None:
  if padding not in _PADDINGS:
    raise ValueError(f"{op_name!r}: padding must be one of {_PADDINGS}, got {padding!r}.")


def _canonical_strides(op_name: str, conv_dimension: int, strides) -> list:
  """Strides as the full list [1, (sd,) sh, sw, 1]; None means all ones."""
  if strides is None:
    return [1] * (conv_dimension + 2)
  strides = list(strides)
  if (len(strides) != conv_dimension + 2 or strides[0] != 1 or strides[-1] != 1
      or not all(isinstance(s, int) and s > 0 for s in strides)):
    raise ValueError(
        f"{op_name!r}: strides must be a list of {conv_dimension + 2} positive ints with 1 for the "
        f"batch and channel dims, e.g. {[1] + [2] * conv_dimension + [1]}; got {strides!r}.")
  return strides


def _check_channels_match(op_name: str, what: str, expected: Dimension, actual: Dimension) -> None:
  if expected != actual:
    raise ValueError(
        f"{op_name!r}: Dimensions do not match: {what} is {actual} but the input's channel dim is "
        f"{expected}; give the filter the input's channel Dimension (same name and size).")


def _sum_over_split_dims(lowering, op, laid_out, summed_dims):
  """Wraps per-slice partial sums in a lazy allreduce over the mesh axes splitting summed_dims."""
  mesh_impl = lowering.mesh_impl(op)
  mesh_axes = sorted({a for a in (mesh_impl.tensor_dimension_to_mesh_axis(d) for d in summed_dims)
                      if a is not None})
  if not mesh_axes:
    return laid_out
  return lowering.comm(op).lazy_allreduce_sum(laid_out, mesh_axes, type(op).__name__)


def _output_size(size: int, filter_size: int, stride: int, padding: str, is_transpose: bool,
                 round_up: bool = False) -> int:
  """Output length of a (transposed) convolution along one spatial dim; `round_up` gives TF's."""
  if is_transpose:
    return size * stride + (max(filter_size - stride, 0) if padding == "VALID" else 0)
  if padding == "VALID":
    size -= filter_size - 1
  return -(-size // stride) if round_up else size // stride


def _conv_unsplittable_reason(dim_name: str) -> str:
  return (f"a convolution needs {dim_name!r}, a spatial or filter-spatial dim, whole on every "
          f"processor. To partition an image spatially, add a blocks dim (e.g. [batch, h_blocks, "
          f"w_blocks, h, w, c] with h_blocks split), exchange halos with mtf.halo_exchange and run a "
          f"VALID conv, or use the mtf.layers.*_with_blocks layers")


# ---- forward convolutions ----

class _ConvOperation(Operation):
  """Shape rule, lowering and gradient shared by the four forward convolutions."""

  _conv_dimension = 2
  _is_transpose = False
  _default_name = "conv"

  def __init__(self, conv_input: Tensor, conv_filter: Tensor, strides, padding: str,
               name: Optional[str] = None):
    super().__init__([conv_input, conv_filter], name=name or self._default_name)
    cd = self._conv_dimension
    _check_dtypes(self.name, [conv_input, conv_filter])
    _check_ranks(self.name, cd, conv_input.shape, conv_filter.shape)
    _check_padding(self.name, padding)
    self._strides = _canonical_strides(self.name, cd, strides)
    self._padding = padding
    dims = conv_input.shape.dims
    self._spatial_dims = dims[-(cd + 1):-1]
    self._in_dim = dims[-1]
    self._filter_spatial_dims = conv_filter.shape.dims[:cd]
    # Regular filters map [in -> out]; transposed filters are stored as [out, in].
    f_in_dim, self._out_dim = conv_filter.shape.dims[cd:]
    if self._is_transpose:
      self._out_dim, f_in_dim = f_in_dim, self._out_dim
    _check_channels_match(self.name, f"filter {conv_filter.shape}'s input channel dim", self._in_dim,
                          f_in_dim)
    out_spatial = []
    for dim, f_dim, stride, role in zip(self._spatial_dims, self._filter_spatial_dims,
                                        self._strides[1:-1], _SPATIAL_ROLES[cd]):
      size = _output_size(dim.size, f_dim.size, stride, padding, self._is_transpose)
      if size <= 0:
        raise ValueError(
            f"{self.name!r}: output dim {role} would be empty: input {dim}, filter {f_dim}, "
            f"stride {stride}, padding {padding}; use padding='SAME', a smaller filter or stride.")
      out_spatial.append(Dimension(dim.name, size))
    output_shape = Shape(dims[:-(cd + 1)] + out_spatial + [self._out_dim])
    self._outputs = [Tensor(self, output_shape, conv_input.dtype)]
    self._splittable_dims, self._unsplittable_dims = self._initialize_splittable_and_unsplittable_dims(
        "splittable", [d.name for d in self._spatial_dims + self._filter_spatial_dims])

  def unsplittable_reason(self, dim_name: str) -> str:
    return _conv_unsplittable_reason(dim_name)

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    conv_input, conv_filter = self.inputs
    cd, strides, padding = self._conv_dimension, self._strides, self._padding
    out_slice_shape = mesh_impl.slice_shape(self.outputs[0].shape)

    def tf_fn(x, f):
      if self._is_transpose:
        return _tf_conv_backprop_input(cd, out_slice_shape, f, x, strides, padding)
      return _tf_conv(cd, x, f, strides, padding, out_slice_shape)
    y = mesh_impl.slicewise(tf_fn, lowering.tensors[conv_input], lowering.tensors[conv_filter])
    lowering.set_tensor_lowering(self.outputs[0], _sum_over_split_dims(lowering, self, y, [self._in_dim]))

  def gradient(self, grad_ys):
    dy = grad_ys[0]
    conv_input, conv_filter = self.inputs
    args = (self._conv_dimension, self._is_transpose)
    return [
        Conv2or3dBackpropInputOperation(*args, conv_input.shape, conv_filter, dy, self._strides,
                                        self._padding).outputs[0],
        Conv2or3dBackpropFilterOperation(*args, conv_input, conv_filter.shape, dy, self._strides,
                                         self._padding).outputs[0],
    ]


class Conv2dOperation(_ConvOperation):
  """Like tf.nn.conv2d (NHWC, dilation 1): input [...batch, h, w, in], filter [fh, fw, in, out].

  Output spatial size is h // stride (SAME) or (h - fh + 1) // stride (VALID): where TF would
  round up, the last, partial-window output is dropped.

  Example: `Conv2dOperation(x, kernel, [1, 1, 1, 1], "SAME").outputs[0]` has x's shape with `in`
  replaced by `out`.
  """

  _conv_dimension = 2
  _default_name = "conv2d"


class Conv3dOperation(_ConvOperation):
  """Like tf.nn.conv3d (NDHWC): input [...batch, d, h, w, in], filter [fd, fh, fw, in, out]."""

  _conv_dimension = 3
  _default_name = "conv3d"


class Conv2dTransposeOperation(_ConvOperation):
  """Like tf.nn.conv2d_transpose: input [...batch, h, w, in], filter [fh, fw, out, in].

  Output spatial size is in*stride (SAME) or in*stride + max(f - stride, 0) (VALID).
  """

  _conv_dimension = 2
  _is_transpose = True
  _default_name = "conv2d_transpose"


class Conv3dTransposeOperation(_ConvOperation):
  """Like tf.nn.conv3d_transpose: input [...batch, d, h, w, in], filter [fd, fh, fw, out, in]."""

  _conv_dimension = 3
  _is_transpose = True
  _default_name = "conv3d_transpose"


# ---- gradients ----

class _ConvBackpropOperation(Operation):
  """Common arguments of the two conv backprop ops; the layout check keeps spatial and filter-spatial
  dims whole, as for the forward convolution. They have no gradient (no second-order gradients)."""

  def __init__(self, conv_dimension: int, is_transpose: bool, inputs, strides, padding, name: str):
    super().__init__(inputs, name=name)
    if conv_dimension not in _SPATIAL_ROLES:
      raise ValueError(f"{self.name!r}: conv_dimension must be 2 or 3, got {conv_dimension!r}.")
    _check_padding(self.name, padding)
    self._conv_dimension = conv_dimension
    self._is_transpose = is_transpose
    self._strides = _canonical_strides(self.name, conv_dimension, strides)
    self._padding = padding

  def _finish(self, output_shape: Shape, dy: Tensor, input_shape: Shape, filter_shape: Shape):
    _check_dtypes(self.name, self.inputs)
    _check_ranks(self.name, self._conv_dimension, input_shape, filter_shape)
    self._outputs = [Tensor(self, output_shape, dy.dtype)]
    cd = self._conv_dimension
    spatial_dims = input_shape.dims[-(cd + 1):-1] + filter_shape.dims[:cd]
    self._splittable_dims, self._unsplittable_dims = self._initialize_all_dimensions_as_splittable()
    self._spatial_dim_names = frozenset(d.name for d in spatial_dims)
    # The channel dim on dy's side of the conv: summed over when going back to the input.
    self._dy_channel_dim = filter_shape.dims[cd + (0 if self._is_transpose else 1)]

  @property
  def layout_unsplittable_dims(self) -> frozenset:
    """Spatial and filter-spatial dims: declared splittable (as upstream), but never split here."""
    return self._spatial_dim_names

  def unsplittable_reason(self, dim_name: str) -> str:
    return _conv_unsplittable_reason(dim_name)


class Conv2or3dBackpropInputOperation(_ConvBackpropOperation):
  """d(loss)/d(conv input), given the filter and dy; output has `input_shape`."""

  def __init__(self, conv_dimension: int, is_transpose: bool, input_shape, conv_filter: Tensor,
               dy: Tensor, strides, padding: str, name: Optional[str] = None):
    default_name = "conv%dd%s_backprop" % (conv_dimension, "_transpose" if is_transpose else "")
    super().__init__(conv_dimension, is_transpose, [conv_filter, dy], strides, padding,
                     name or default_name)
    self._input_shape = convert_to_shape(input_shape)
    self._finish(self._input_shape, dy, self._input_shape, conv_filter.shape)

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    conv_filter, dy = self.inputs
    cd, strides, padding = self._conv_dimension, self._strides, self._padding
    input_slice_shape = mesh_impl.slice_shape(self._input_shape)

    def tf_fn(f, g):
      if self._is_transpose:
        return _tf_conv(cd, g, f, strides, padding, input_slice_shape)
      return _tf_conv_backprop_input(cd, input_slice_shape, f, g, strides, padding)
    dx = mesh_impl.slicewise(tf_fn, lowering.tensors[conv_filter], lowering.tensors[dy])
    lowering.set_tensor_lowering(
        self.outputs[0], _sum_over_split_dims(lowering, self, dx, [self._dy_channel_dim]))


class Conv2or3dBackpropFilterOperation(_ConvBackpropOperation):
  """d(loss)/d(filter), given the conv input and dy; output has `filter_shape`."""

  def __init__(self, conv_dimension: int, is_transpose: bool, conv_input: Tensor, filter_shape,
               dy: Tensor, strides, padding: str, name: Optional[str] = None):
    default_name = "conv%dd%s_backprop_filter" % (conv_dimension, "_transpose" if is_transpose else "")
    super().__init__(conv_dimension, is_transpose, [conv_input, dy], strides, padding,
                     name or default_name)
    self._filter_shape = convert_to_shape(filter_shape)
    self._finish(self._filter_shape, dy, conv_input.shape, self._filter_shape)

  def lower(self, lowering):
    mesh_impl = lowering.mesh_impl(self)
    conv_input, dy = self.inputs
    cd, strides, padding = self._conv_dimension, self._strides, self._padding
    filter_slice_shape = mesh_impl.slice_shape(self._filter_shape)

    def tf_fn(x, g):
      # A transposed conv is the adjoint of a conv, so dy and the input trade places.
      if self._is_transpose:
        x, g = g, x
      return _tf_conv_backprop_filter(cd, x, filter_slice_shape, g, strides, padding)
    dw = mesh_impl.slicewise(tf_fn, lowering.tensors[conv_input], lowering.tensors[dy])
    batch_dims = conv_input.shape.dims[:-(cd + 1)]
    lowering.set_tensor_lowering(self.outputs[0], _sum_over_split_dims(lowering, self, dw, batch_dims))


def _backprop_input(conv_dimension: int, is_transpose: bool):
  def fn(input_shape, conv_filter: Tensor, dy: Tensor, strides: Sequence[int], padding: str,
         name: Optional[str] = None) -> Tensor:
    return Conv2or3dBackpropInputOperation(conv_dimension, is_transpose, input_shape, conv_filter, dy,
                                           strides, padding, name=name).outputs[0]
  fn.__name__ = "conv%dd%s_backprop_input" % (conv_dimension, "_transpose" if is_transpose else "")
  fn.__doc__ = f"Gradient of a {fn.__name__[:-15]} with respect to its input (shape `input_shape`)."
  return fn


def _backprop_filter(conv_dimension: int, is_transpose: bool):
  def fn(conv_input: Tensor, filter_shape, dy: Tensor, strides: Sequence[int], padding: str,
         name: Optional[str] = None) -> Tensor:
    return Conv2or3dBackpropFilterOperation(conv_dimension, is_transpose, conv_input, filter_shape, dy,
                                            strides, padding, name=name).outputs[0]
  fn.__name__ = "conv%dd%s_backprop_filter" % (conv_dimension, "_transpose" if is_transpose else "")
  fn.__doc__ = f"Gradient of a {fn.__name__[:-16]} with respect to its filter (shape `filter_shape`)."
  return fn


conv2d_backprop_input = _backprop_input(2, False)
conv2d_backprop_filter = _backprop_filter(2, False)
conv3d_backprop_input = _backprop_input(3, False)
conv3d_backprop_filter = _backprop_filter(3, False)
conv2d_transpose_backprop_input = _backprop_input(2, True)
conv2d_transpose_backprop_filter = _backprop_filter(2, True)
conv3d_transpose_backprop_input = _backprop_input(3, True)
conv3d_transpose_backprop_filter = _backprop_filter(3, True)


# ---- upstream's conv3d_backprop_*_v2 names ----
#
# 0.1.21's ops module imported TensorFlow's conv3d_backprop_filter_v2 / conv3d_backprop_input_v2,
# and `from ops import *` made them `mtf.<name>`: clients call them with TF tensors and TF's
# arguments. They keep doing exactly that here; given mtf Tensors, the same call builds the mtf op.

def _v2_is_mtf(op_name: str, tensors: dict) -> bool:
  """True if every tensor argument is an mtf Tensor, False if none is; mixing them raises."""
  kinds = {name: isinstance(t, Tensor) for name, t in tensors.items()}
  if len(set(kinds.values())) > 1:
    raise ValueError(
        f"{op_name}: {', '.join(n for n, m in kinds.items() if m)} are mtf Tensors but "
        f"{', '.join(n for n, m in kinds.items() if not m)} are not; pass all mtf Tensors (the mtf "
        f"op; sizes as an mtf Shape) or all TensorFlow tensors (TensorFlow's op).")
  return all(kinds.values())


def _check_v2_mtf_options(op_name: str, data_format: str, dilations) -> None:
  if data_format != "NDHWC":
    raise ValueError(f"{op_name}: on mtf Tensors only data_format='NDHWC' (channels last) is supported, "
                     f"got {data_format!r}; transpose the tensors' dimensions instead.")
  if list(dilations) != [1] * 5:
    raise ValueError(f"{op_name}: on mtf Tensors dilations must be [1, 1, 1, 1, 1], got {list(dilations)!r}.")


def conv3d_backprop_filter_v2(input, filter_sizes, out_backprop, strides, padding: str,
                              data_format: str = "NDHWC", dilations=(1, 1, 1, 1, 1), name=None):
  """Gradient of a 3-D convolution with respect to its filter (upstream's `mtf.` name for TF's op).

  With TensorFlow tensors this is `tf.compat.v1.nn.conv3d_backprop_filter_v2` (what 0.1.21's
  `mtf.conv3d_backprop_filter_v2` was), TF gradient included. With mtf Tensors it is
  `mtf.conv3d_backprop_filter(input, filter_sizes, out_backprop, strides, padding, name)`: batch and
  channel dims may be split, spatial dims stay whole (partition space with blocks dims and
  halo_exchange); like upstream's mtf backprop ops it has no gradient.

  Args:
    input: the convolution's input, [...batch, d, h, w, in].
    filter_sizes: the filter's shape: an mtf Shape [fd, fh, fw, in, out] for mtf Tensors, else
      TF's int32 1-D tensor.
    out_backprop: d(loss)/d(conv output), [...batch, d', h', w', out].
    strides: the full stride list [1, sd, sh, sw, 1].
    padding: "SAME" or "VALID".
    data_format: TF's; mtf Tensors need "NDHWC".
    dilations: TF's; mtf Tensors need all ones.
    name: an optional op name.
  Returns:
    d(loss)/d(filter), an mtf Tensor of shape `filter_sizes` or a tf.Tensor.
  """
  op_name = "conv3d_backprop_filter_v2"
  if not _v2_is_mtf(op_name, {"input": input, "out_backprop": out_backprop}):
    return tf.nn.conv3d_backprop_filter_v2(input, filter_sizes, out_backprop, strides, padding,
                                           data_format=data_format, dilations=list(dilations), name=name)
  _check_v2_mtf_options(op_name, data_format, dilations)
  return conv3d_backprop_filter(input, filter_sizes, out_backprop, strides, padding, name=name)


def conv3d_backprop_input_v2(input_sizes, filter, out_backprop, strides, padding: str,
                             data_format: str = "NDHWC", dilations=(1, 1, 1, 1, 1), name=None):
  """Gradient of a 3-D convolution with respect to its input (upstream's `mtf.` name for TF's op).

  With TensorFlow tensors this is TF's Conv3DBackpropInputV2 op (what 0.1.21's
  `mtf.conv3d_backprop_input_v2` was, from gen_nn_ops), TF gradient included. With mtf Tensors it
  is `mtf.conv3d_backprop_input(input_sizes, filter, out_backprop, strides, padding, name)`; a split
  `out` channel dim leaves partial sums that are allreduced lazily; no gradient, as upstream's mtf
  backprop ops.

  Args:
    input_sizes: the convolution input's shape: an mtf Shape [...batch, d, h, w, in] for mtf
      Tensors, else TF's int 1-D tensor.
    filter: the filter, [fd, fh, fw, in, out].
    out_backprop: d(loss)/d(conv output), [...batch, d', h', w', out].
    strides: the full stride list [1, sd, sh, sw, 1].
    padding: "SAME" or "VALID".
    data_format: TF's; mtf Tensors need "NDHWC".
    dilations: TF's; mtf Tensors need all ones.
    name: an optional op name.
  Returns:
    d(loss)/d(input), an mtf Tensor of shape `input_sizes` or a tf.Tensor.
  """
  op_name = "conv3d_backprop_input_v2"
  if not _v2_is_mtf(op_name, {"filter": filter, "out_backprop": out_backprop}):
    return tf.raw_ops.Conv3DBackpropInputV2(
        input_sizes=input_sizes, filter=filter, out_backprop=out_backprop, strides=list(strides),
        padding=padding, data_format=data_format, dilations=list(dilations), name=name)
  _check_v2_mtf_options(op_name, data_format, dilations)
  return conv3d_backprop_input(input_sizes, filter, out_backprop, strides, padding, name=name)
