"""Layouts never change results: random graphs under random meshes and layouts.

Hypothesis draws a chain of ops (elementwise, broadcasting binary ops, einsum, reductions,
softmax, transpose, renames that move a dimension between mesh axes) over named dimensions, a
mesh (1-D, 2-D or 3-D; 1, 2, 4 or 8 processors) and layout rules, and a TF execution mode. The
mtf result and the gradients of a scalar loss must equal the plain-TF computation on one device
and the result on a 1-processor mesh.
"""

import numpy as np
import tensorflow.compat.v1 as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mesh_tensorflow as mtf
from tests.harness import MAX_EXAMPLES, MODES, align_to_names, lower_and_evaluate, mesh_and_layout

DIM_SIZES = {"a": 4, "b": 8, "c": 2, "d": 8, "e": 4, "f": 8}
LETTERS = {name: chr(ord("p") + i) for i, name in enumerate(DIM_SIZES)}
UNARY = {
    "tanh": (mtf.tanh, tf.tanh), "sigmoid": (mtf.sigmoid, tf.sigmoid),
    "square": (mtf.square, tf.square), "sin": (mtf.sin, tf.sin), "negative": (mtf.negative, tf.negative),
}
BINARY = {"add": (mtf.add, tf.add), "sub": (mtf.sub, tf.subtract), "multiply": (mtf.multiply, tf.multiply)}
# reduce_max is left out: broadcasts create ties, where mtf (like upstream) routes the full
# gradient to every maximum and TF splits it; tests/ops/test_reduce.py covers it tie-free.
REDUCTIONS = {"sum": (mtf.reduce_sum, tf.reduce_sum), "mean": (mtf.reduce_mean, tf.reduce_mean)}


@st.composite
def programs(draw):
  """A list of op descriptions over two inputs of random shapes."""
  names = list(DIM_SIZES)
  shapes = [draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)) for _ in range(2)]
  steps = []
  for _ in range(draw(st.integers(1, 5))):
    kind = draw(st.sampled_from(["unary", "binary", "einsum", "reduce", "softmax", "transpose", "rename"]))
    steps.append((kind, draw(st.integers(0, 10 ** 6))))
  return shapes, steps


def _run_program(shapes, steps, arrays, mtf_mesh=None):
  """Applies the program either to mtf tensors (mtf_mesh given) or to TF tensors.

  Values are (tensor, dim-name list) pairs; the random choices are seeded by each step's seed so
  both interpretations make the same choices.
  """
  values = []
  for shape, array in zip(shapes, arrays):
    if mtf_mesh is not None:
      dims = [mtf.Dimension(n, DIM_SIZES[n]) for n in shape]
      values.append((mtf.import_tf_tensor(mtf_mesh, tf.constant(array), shape=dims), list(shape)))
    else:
      values.append((tf.constant(array), list(shape)))
  inputs = [v[0] for v in values]
  use_mtf = mtf_mesh is not None
  for kind, seed in steps:
    rng = np.random.RandomState(seed)
    x, x_names = values[rng.randint(len(values))]
    y, y_names = values[rng.randint(len(values))]
    if kind == "unary":
      fns = UNARY[sorted(UNARY)[rng.randint(len(UNARY))]]
      values.append(((fns[0] if use_mtf else fns[1])(x), x_names))
    elif kind == "binary":
      fns = BINARY[sorted(BINARY)[rng.randint(len(BINARY))]]
      out_names = x_names + [n for n in y_names if n not in x_names]
      if use_mtf:
        out_dims = [mtf.Dimension(n, DIM_SIZES[n]) for n in out_names]
        values.append((fns[0](x, y, output_shape=mtf.Shape(out_dims)), out_names))
      else:
        aligned = [align_to_names(v, v_names, out_names) for v, v_names in ((x, x_names), (y, y_names))]
        values.append((fns[1](*aligned), out_names))
    elif kind == "einsum":
      union = x_names + [n for n in y_names if n not in x_names]
      out_names = [n for n in union if rng.rand() < 0.5]
      if use_mtf:
        values.append((mtf.einsum([x, y], output_shape=[mtf.Dimension(n, DIM_SIZES[n]) for n in out_names]),
                       out_names))
      else:
        eq = "%s,%s->%s" % tuple("".join(LETTERS[n] for n in ns) for ns in (x_names, y_names, out_names))
        values.append((tf.einsum(eq, x, y), out_names))
    elif kind == "reduce":
      fns = REDUCTIONS[sorted(REDUCTIONS)[rng.randint(len(REDUCTIONS))]]
      reduced = [n for n in x_names if rng.rand() < 0.5]
      out_names = [n for n in x_names if n not in reduced]
      if use_mtf:
        out_shape = [mtf.Dimension(n, DIM_SIZES[n]) for n in out_names]
        values.append((fns[0](x, output_shape=out_shape), out_names))
      else:
        values.append((fns[1](x, axis=[x_names.index(n) for n in reduced]), out_names))
    elif kind == "softmax":
      n = x_names[rng.randint(len(x_names))] if x_names else None
      if n is None:
        continue
      if use_mtf:
        values.append((mtf.softmax(x, mtf.Dimension(n, DIM_SIZES[n])), x_names))
      else:
        values.append((tf.nn.softmax(x, axis=x_names.index(n)), x_names))
    elif kind == "transpose":
      perm = list(rng.permutation(len(x_names)))
      out_names = [x_names[i] for i in perm]
      if use_mtf:
        values.append((mtf.transpose(x, [mtf.Dimension(n, DIM_SIZES[n]) for n in out_names]), out_names))
      else:
        values.append((tf.transpose(x, perm) if perm else x, out_names))
    elif kind == "rename":
      free = [n for n in DIM_SIZES if n not in x_names]
      movable = [n for n in x_names if any(DIM_SIZES[f] == DIM_SIZES[n] for f in free)]
      if not movable:
        continue
      old = movable[rng.randint(len(movable))]
      candidates = [f for f in free if DIM_SIZES[f] == DIM_SIZES[old]]
      new = candidates[rng.randint(len(candidates))]
      out_names = [new if n == old else n for n in x_names]
      values.append((mtf.rename_dimension(x, old, new) if use_mtf else x, out_names))
  return inputs, values[-1]


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(programs(), mesh_and_layout(DIM_SIZES), st.sampled_from(MODES), st.integers(0, 1000))
def test_random_graph_matches_tf_and_single_processor(program, mesh_layout, mode, seed):
  shapes, steps = program
  mesh_shape, layout = mesh_layout
  rng = np.random.RandomState(seed)
  arrays = [rng.uniform(-1, 1, [DIM_SIZES[n] for n in s]).astype(np.float32) for s in shapes]
  holder = {}

  def build(mesh):
    inputs, (out, names) = _run_program(shapes, steps, arrays, mesh)
    w = np.random.RandomState(seed + 1).uniform(-1, 1, out.shape.to_integer_list).astype(np.float32)
    holder["names"], holder["w"] = names, w
    loss = mtf.reduce_sum(out * mtf.import_tf_tensor(mesh, tf.constant(w), shape=out.shape))
    grads = mtf.gradients([loss], inputs)
    return [out] + [g if g is not None else mtf.zeros_like(x) for g, x in zip(grads, inputs)]

  sharded = lower_and_evaluate(build, mesh_shape, layout, mode)
  single = lower_and_evaluate(build, "all:1", "", mode)
  with tf.Graph().as_default():
    inputs, (out, names) = _run_program(shapes, steps, arrays)
    assert names == holder["names"]
    loss = tf.reduce_sum(out * tf.constant(holder["w"]))
    fetches = [out] + tf.gradients(loss, inputs, unconnected_gradients="zero")
    with tf.Session() as sess:
      expected = sess.run(fetches)
  for got, one, want in zip(sharded, single, expected):
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(got, one, rtol=2e-4, atol=2e-4)
