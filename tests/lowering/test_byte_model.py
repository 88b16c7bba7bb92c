"""One byte model: the communication layer's events and the layout plans' steps count the same bytes.

Each case lowers one collective-inducing op in a dry run (`mtf.dry_run`) on a 1-D, 2-D and 3-D mesh
and checks the recorded bytes against numbers worked out by hand from the model in
`_lowering/plan.py`'s `bytes_sent`; for reshapes, `plan.plan_reshape` must plan the same
collectives with the same bytes.
"""

from __future__ import annotations

import pytest
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._lowering import plan

B, I, J = mtf.Dimension("b", 8), mtf.Dimension("i", 4), mtf.Dimension("j", 12)
C8, C12, K = mtf.Dimension("c", 8), mtf.Dimension("c", 12), mtf.Dimension("k", 4)

MESHES = {  # mesh, layout (b, i, j are split; k takes a split in an alltoall)
    "1d": ("x:4", "b:x;k:x"),
    "2d": ("x:2;y:4", "b:x;j:y;k:y"),
    "3d": ("x:2;y:2;z:2", "b:x;i:y;j:z;k:z"),
}


def _x(mesh):
  return mtf.zeros(mesh, mtf.Shape([B, I, J]), dtype=tf.float32)


def _allreduce(mesh, ndims):
  del ndims
  return mtf.exp(mtf.reduce_sum(_x(mesh), output_shape=[I, J]))  # exp forces the lazy sum


def _allconcat(mesh, ndims):  # j's split (or, on 1-D, b's) is dropped
  return mtf.reshape(_x(mesh), [C8, I, J] if ndims == 1 else [B, I, C12])


def _alltoall(mesh, ndims):  # the split moves to k, which takes i's place
  return mtf.reshape(_x(mesh), [C8, K, J] if ndims == 1 else [B, K, C12])


def _shift(mesh, ndims, wrap=False):
  del ndims
  return mtf.shift(_x(mesh), offset=1, dim=B, wrap=wrap)


# Hand-computed from the model, float32 (4 bytes), P processors, n the group, S the slice bytes:
# allreduce 2 (n - 1) S P / n, allconcat (n - 1) S P, alltoall (n - 1) S P / n, receive S per mover.
EXPECTED = {
    # 1-D x:4: x slice of [b, i, j] is [2, 4, 12] = 384 B, the sum's [4, 12] = 192 B.
    ("1d", "allreduce"): [("allreduce", 2 * 3 * 192)],
    ("1d", "allconcat"): [("allconcat", 3 * 384 * 4)],
    ("1d", "alltoall"): [("alltoall", 3 * 96 * 4)],
    # A shift by one moves each slice's last row [1, 4, 12] = 192 B to the next processor (sources
    # [None, 0, 1, 2]: 3 movers; wrapped: 4), then keeps the other rows (a receive from itself).
    ("1d", "shift"): [("receive", 3 * 192), ("receive", 0)],
    ("1d", "shift_wrap"): [("receive", 4 * 192), ("receive", 0)],
    # 2-D x:2;y:4 (P = 8): slice [4, 4, 3] = 192 B; the sum over x is [4, 3] = 48 B.
    ("2d", "allreduce"): [("allreduce", 2 * 1 * 48 * 4)],
    ("2d", "allconcat"): [("allconcat", 3 * 192 * 8)],
    ("2d", "alltoall"): [("alltoall", 3 * 48 * 8)],
    ("2d", "shift"): [("receive", 1 * 48 * 4), ("receive", 0)],  # rows of 48 B; 4 groups of 2
    ("2d", "shift_wrap"): [("receive", 2 * 48 * 4), ("receive", 0)],
    # 3-D x:2;y:2;z:2 (P = 8): slice [4, 2, 6] = 192 B; the sum over x is [2, 6] = 48 B.
    ("3d", "allreduce"): [("allreduce", 2 * 1 * 48 * 4)],
    ("3d", "allconcat"): [("allconcat", 1 * 192 * 8)],
    # i's y split goes (allconcat: slice [4, 4, 6] = 384 B after), then z moves from j to k.
    ("3d", "alltoall"): [("allconcat", 1 * 192 * 8), ("alltoall", 1 * 192 * 8)],
    ("3d", "shift"): [("receive", 1 * 48 * 4), ("receive", 0)],  # rows [1, 2, 6] = 48 B
    ("3d", "shift_wrap"): [("receive", 2 * 48 * 4), ("receive", 0)],
}

BUILDERS = {"allreduce": _allreduce, "allconcat": _allconcat, "alltoall": _alltoall,
            "shift": _shift, "shift_wrap": lambda mesh, ndims: _shift(mesh, ndims, wrap=True)}


def _events(mesh_name, build):
  mesh_shape, layout = MESHES[mesh_name]
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    out = build(mesh, mtf.convert_to_shape(mesh_shape).ndims)
    return list(mtf.dry_run(graph, mesh_shape, layout).events), out


@pytest.mark.parametrize("mesh_name,collective", sorted(EXPECTED))
def test_recorded_bytes_equal_the_hand_computed_model(mesh_name, collective):
  events, _ = _events(mesh_name, BUILDERS[collective])
  assert [(e.kind, e.bytes_sent) for e in events] == EXPECTED[mesh_name, collective]


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("collective", ["allconcat", "alltoall"])
def test_a_reshape_plan_moves_the_bytes_its_lowering_records(mesh_name, collective):
  events, out = _events(mesh_name, BUILDERS[collective])
  mesh_shape, layout = MESHES[mesh_name]
  steps = plan.plan_reshape(mtf.Shape([B, I, J]), out.shape, mesh_shape, layout)
  collectives = [s for s in steps if s.kind is not None]
  assert [(s.kind, s.bytes_moved(4)) for s in collectives] == [(e.kind, e.bytes_sent) for e in events]
  assert plan.total_bytes_moved(steps, 4) == sum(e.bytes_sent for e in events)


@pytest.mark.parametrize("kind,n,p,slice_bytes,expected", [
    ("allreduce", 4, 8, 100, 2 * 3 * 100 * 2), ("allconcat", 2, 8, 100, 800),
    ("alltoall", 4, 4, 64, 3 * 16 * 4), ("allsplit", 4, 4, 64, 0)])
def test_bytes_sent_per_kind(kind, n, p, slice_bytes, expected):
  assert plan.bytes_sent(kind, n, p, slice_bytes) == expected


def test_bytes_sent_counts_receivers_of_another_processors_slice():
  # group of 4, 8 processors (2 groups): 0 <- 0 stays, 1 <- 0 and 2 <- 3 move, 3 gets zeros
  assert plan.bytes_sent("receive", 4, 8, 10, source_pcoord=[0, 0, 3, None]) == 2 * 10 * 2


def test_bytes_sent_refuses_an_unknown_kind():
  with pytest.raises(ValueError, match="Unknown collective kind 'broadcast'"):
    plan.bytes_sent("broadcast", 2, 2, 8)
