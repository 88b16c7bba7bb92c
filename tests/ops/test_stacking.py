"""Variable stacking (Graph.rewrite_stack_variables, StackedVariable) and Graph.combine_assignments.

The key property: a training step (variables, gradients, assign_sub updates) gives the same
values lowered with autostack=True as with autostack=False, on 1, 2 and 8 processors, in graph
and eager mode, and checkpoints (the master variables) keep their names.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from tests.harness import MODES, cpu_devices, session_config


def _impl(mesh_shape, layout=""):
  n = mtf.convert_to_shape(mesh_shape).size
  return mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout, cpu_devices(n))


def _var(mesh, name, shape="a:4;b:6", value=0.0, **kwargs):
  return mtf.get_variable(mesh, name, shape, initializer=tf.constant_initializer(value),
                          **kwargs).operation


def _stacked(graph):
  return [op for op in graph.operations if isinstance(op, mtf.StackedVariable)]


# ---- StackedVariable ----

def test_stacked_variable_wraps_the_original_masters_without_creating_one():
  with tf.Graph().as_default():
    mesh = mtf.Mesh(mtf.Graph(), "m")
    vs = [_var(mesh, "w%d" % i, value=i + 1.0) for i in range(3)]
    names_before = [v.name for v in tf.global_variables()]
    sv = mtf.StackedVariable(vs)
    assert [v.name for v in tf.global_variables()] == names_before
    assert sv.name == "stacked/w0"
    assert sv.shape == mtf.convert_to_shape("stacked:3;a:4;b:6")
    assert sv.original_names == ["w0", "w1", "w2"]
    assert sv.is_stacked and sv.trainable and sv.dtype is vs[0].dtype
    assert sv.master_device == vs[0].master_device
    new_value = np.arange(72, dtype=np.float32).reshape(3, 4, 6)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      np.testing.assert_array_equal(sess.run(sv.get_master())[:, 0, 0], [1.0, 2.0, 3.0])
      sess.run(sv.assign_to_master(tf.constant(new_value)))
      for i, v in enumerate(vs):
        np.testing.assert_array_equal(sess.run(v.get_master()), new_value[i])


# ---- rewrite_stack_variables ----

def test_rewrite_groups_by_shape_dtype_trainable_and_assign_ops():
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "m")
    w = [_var(mesh, "w%d" % i) for i in range(3)]
    frozen = _var(mesh, "frozen", trainable=False)
    ints = [_var(mesh, "i%d" % i, value=0, dtype=tf.int32) for i in range(2)]
    vec = [_var(mesh, "v%d" % i, shape="b:6") for i in range(2)]
    assigned = [_var(mesh, "p%d" % i) for i in range(2)]
    update = graph.combine_assignments(
        [mtf.assign(p, mtf.ones(mesh, "a:4;b:6") * (i + 1.0)) for i, p in enumerate(assigned)])[0]
    lone = _var(mesh, "lone")  # same key as w0..w2: joins their group

    graph.rewrite_stack_variables(mesh_to_impl={mesh: _impl("all:2")})

    groups = {sv.name: sv.original_names for sv in _stacked(graph)}
    assert groups == {"stacked/w0": ["w0", "w1", "w2", "lone"], "stacked/i0": ["i0", "i1"],
                      "stacked/v0": ["v0", "v1"], "stacked/p0": ["p0", "p1"]}
    assert graph.all_variables == [graph.operations[0]] + [
        op for op in graph.operations[1:] if isinstance(op, mtf.Variable)]
    assert frozen in graph.all_variables and frozen not in graph.trainable_variables
    assert {v.name for v in graph.trainable_variables} == {
        "stacked/w0", "stacked/i0", "stacked/v0", "stacked/p0"}
    for v in w + ints + vec + assigned + [lone]:
      unstack_op = v.outputs[0].operation
      assert isinstance(unstack_op, mtf.UnstackOperation)
      assert isinstance(unstack_op.inputs[0].operation, mtf.StackedVariable)
      assert v not in graph.operations
    # The grouped Assign now writes one stack of both values to the stacked variable.
    assert [v.name for v in update.variables] == ["stacked/p0"]
    stack_op = update.inputs[0].operation
    assert isinstance(stack_op, mtf.StackOperation)
    assert graph.operations.index(stack_op) < graph.operations.index(update)


def test_max_combined_sizes_limit_the_group_size():
  def groups(**limits):
    with tf.Graph().as_default():
      graph = mtf.Graph()
      mesh = mtf.Mesh(graph, "m")
      [_var(mesh, "w%d" % i) for i in range(5)]  # 24 entries each
      graph.rewrite_stack_variables(**{k: v(mesh) if callable(v) else v for k, v in limits.items()})
      return [sv.original_names for sv in _stacked(graph)]
  assert groups(max_combined_variable_size=48) == [["w0", "w1"], ["w2", "w3"]]
  assert groups(max_combined_slice_size=36) == [["w0", "w1", "w2", "w3", "w4"]]  # no mesh_to_impl
  # Split over 2 processors a slice holds 12 entries, so 36 allows 3 per group.
  assert groups(max_combined_slice_size=36,
                mesh_to_impl=lambda mesh: {mesh: _impl("all:2", "a:all")}) == [
                    ["w0", "w1", "w2"], ["w3", "w4"]]


def test_no_stacking_on_a_one_processor_mesh():
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "m")
    vs = [_var(mesh, "w%d" % i) for i in range(3)]
    ops_before = list(graph.operations)
    graph.rewrite_stack_variables(mesh_to_impl={mesh: _impl("all:1")})
    assert graph.operations == ops_before and graph.all_variables == vs and not _stacked(graph)


def test_rewriting_twice_raises():
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "m")
    [_var(mesh, "w%d" % i) for i in range(2)]
    graph.rewrite_stack_variables()
    with pytest.raises(ValueError, match="already stacked; it may be called once per graph"):
      graph.rewrite_stack_variables()
    lowering = mtf.Lowering(graph, {mesh: _impl("all:2")})  # lowers the stacked graph as it is
    assert len(lowering.variables) == 1


# ---- combine_assignments ----

def test_combine_assignments_makes_one_assign_per_assign_fn():
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "m")
    vs = [_var(mesh, "w%d" % i) for i in range(3)]
    one = mtf.ones(mesh, "a:4;b:6")
    assigns = [mtf.assign_sub(vs[0], one), mtf.assign(vs[1], one), mtf.assign_sub(vs[2], one)]
    combined = graph.combine_assignments(assigns)
    assert [a.assign_fn for a in combined] == [mtf.assign_sub_slice, mtf.assign_slice]
    assert [[v.name for v in a.variables] for a in combined] == [["w0", "w2"], ["w1"]]
    assert not set(assigns) & set(graph.operations)
    assert all(a in graph.operations for a in combined)
    with pytest.raises(ValueError, match="is not an mtf.Assign"):
      graph.combine_assignments([vs[0]])


# ---- a training step, stacked vs not ----

INIT = {name: np.random.RandomState(i).uniform(-1, 1, size).astype(np.float32)
        for i, (name, size) in enumerate([("w1", (8, 4)), ("w2", (8, 4)), ("b1", (4,)), ("b2", (4,)),
                                          ("w3", (4, 2))])}
X = np.random.RandomState(9).uniform(-1, 1, (4, 8)).astype(np.float32)


def _training_step(mesh_shape, layout, autostack, mode):
  """Lowers loss + gradients + assign_sub updates, runs one step; returns (values, master names).

  values: the loss, the gradients, every variable re-read after the step and (graph mode) every
  master after copy_slices_to_masters. In eager mode everything runs while lowering, so the
  reads are the values at lowering (snapshots) and copy_slices_to_masters ran before the step.
  """
  def build_and_lower():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    shapes = {"w1": "d:8;h:4", "w2": "d:8;h:4", "b1": "h:4", "b2": "h:4", "w3": "h:4;o:2"}
    ws = {n: mtf.get_variable(mesh, n, shapes[n], initializer=tf.constant_initializer(INIT[n]))
          for n in shapes}
    step = mtf.get_variable(mesh, "step", [], trainable=False, initializer=tf.zeros_initializer())
    x = mtf.import_tf_tensor(mesh, tf.constant(X), "batch:4;d:8")
    h = mtf.relu(mtf.einsum([x, ws["w1"]], reduced_dims=[x.shape.dims[1]]) + ws["b1"])
    h *= mtf.einsum([x, ws["w2"]], reduced_dims=[x.shape.dims[1]]) + ws["b2"]
    loss = mtf.reduce_sum(mtf.square(mtf.einsum([h, ws["w3"]], output_shape="batch:4;o:2")))
    variables = list(graph.trainable_variables)
    grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
    outputs = {"loss": loss, **{"grad/" + v.name: g for v, g in zip(variables, grads)}}
    updates = [mtf.assign_sub(v, g * 0.01) for v, g in zip(variables, grads)]
    updates.append(mtf.assign_add(step, mtf.ones(mesh, [])))
    updates = graph.combine_assignments(updates)
    variables = list(graph.all_variables)
    outputs.update({v.name: mtf.read_variable(v) for v in variables})
    lowering = mtf.Lowering(graph, {mesh: _impl(mesh_shape, layout)}, autostack=autostack)
    assert bool(_stacked(graph)) == (autostack and mtf.convert_to_shape(mesh_shape).size > 1)
    fetches = {n: lowering.export_to_tf_tensor(t) for n, t in outputs.items()}
    masters = {"master/" + v.name: v.get_master() for v in variables}
    return lowering, updates, fetches, masters

  if mode == "graph":
    with tf.Graph().as_default():
      lowering, updates, fetches, masters = build_and_lower()
      names = sorted(v.name for v in tf.global_variables())
      with tf.Session(config=session_config()) as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(lowering.copy_masters_to_slices())
        before = sess.run({k: t for k, t in fetches.items() if "/" in k or k == "loss"})
        sess.run([lowering.lowered_operation(u) for u in updates])
        after = sess.run({k: t for k, t in fetches.items() if k not in before})
        sess.run(lowering.copy_slices_to_masters())
        return dict(**before, **after, **sess.run(masters)), names
  _, _, fetches, masters = build_and_lower()  # eager: everything ran while lowering
  return {k: t.numpy() for k, t in fetches.items()}, sorted(m.name for m in masters.values())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh_shape, layout", [
    ("all:1", ""), ("all:2", "d:all"), ("rows:2;cols:4", "batch:rows;h:cols"),
])
def test_training_step_gives_the_same_values_with_and_without_autostack(mesh_shape, layout, mode):
  stacked, stacked_names = _training_step(mesh_shape, layout, True, mode)
  plain, plain_names = _training_step(mesh_shape, layout, False, mode)
  assert stacked_names == plain_names == sorted(
      n + ":0" for n in ["b1", "b2", "step", "w1", "w2", "w3"])
  assert sorted(stacked) == sorted(plain)
  for k in plain:
    np.testing.assert_allclose(stacked[k], plain[k], rtol=1e-5, atol=1e-6, err_msg=k)
  if mode == "graph":
    assert stacked["step"] == 1.0
    np.testing.assert_allclose(stacked["w1"], INIT["w1"] - 0.01 * stacked["grad/w1"], rtol=1e-5)
    for name in ["b1", "b2", "step", "w1", "w2", "w3"]:
      np.testing.assert_allclose(stacked["master/" + name], stacked[name], rtol=1e-6)


def test_stacked_variable_on_one_processor_keeps_a_separate_slice():
  """is_stacked: the backend must not use the (computed) stacked master as the slice variable."""
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "m")
    vs = [_var(mesh, "w%d" % i, value=i) for i in range(2)]
    update = graph.combine_assignments([mtf.assign_add(v, mtf.ones(mesh, v.shape)) for v in vs])[0]
    graph.rewrite_stack_variables()  # no mesh_to_impl: stacks even for one processor
    lowering = mtf.Lowering(graph, {mesh: _impl("all:1")}, autostack=False)
    (laid_out,) = lowering.variables.values()
    assert not laid_out.slice_is_master
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(lowering.copy_masters_to_slices())
      sess.run(lowering.lowered_operation(update))
      sess.run(lowering.copy_slices_to_masters())
      np.testing.assert_array_equal(sess.run(vs[1].get_master()), np.full((4, 6), 2.0))
