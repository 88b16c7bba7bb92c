"""Trains a small conv net on images split spatially over 8 virtual CPUs, and checks it against one device.

Each 8x8 image is stored as 2x2 blocks of 4x4 pixels, dims [batch, hb, wb, h, w, c]. The layout
puts the blocks on a 2x2 grid of processors (hb:rows, wb:cols) and the batch on a third mesh dim,
so every processor holds one quarter of each of its images. Each 3x3 conv exchanges a one-pixel
halo with the neighbouring blocks (mtf.halo_exchange) and then runs a VALID conv; the result is the
SAME conv of the whole image. The same net written in plain TensorFlow on whole images, with the
same initial weights and plain SGD, must see the same loss at every step.

Run: python examples/spatial_conv.py   (about 10 s on 2 cores)
"""

from __future__ import annotations

import argparse

import numpy as np
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf

BATCH, HEIGHT, WIDTH = 4, 8, 8
CHANNELS = [3, 8, 8, 1]  # input channels, two hidden layers, one output channel
FILTER = 3
LEARNING_RATE = 0.05


def synthetic_data(rng):
  """Random images, and as target a 3x3 box blur of their channel mean."""
  images = rng.uniform(-1, 1, [BATCH, HEIGHT, WIDTH, CHANNELS[0]]).astype(np.float32)
  gray = np.pad(images.mean(axis=-1), [(0, 0), (1, 1), (1, 1)])
  target = sum(gray[:, i:i + HEIGHT, j:j + WIDTH] for i in range(3) for j in range(3)) / 9
  return images, target[..., None].astype(np.float32)


def to_blocks(image, h_blocks: int, w_blocks: int):
  """[B, H, W, C] -> [B, hb, wb, H/hb, W/wb, C]: block (i, j) holds rows i*h.., columns j*w.."""
  b, height, width, c = image.shape
  return image.reshape(b, h_blocks, height // h_blocks, w_blocks, width // w_blocks, c).transpose(
      0, 1, 3, 2, 4, 5)


def initial_kernels(rng):
  return [rng.normal(0, 0.15, [FILTER, FILTER, c_in, c_out]).astype(np.float32)
          for c_in, c_out in zip(CHANNELS, CHANNELS[1:])]


def build_partitioned(mesh, images, target, kernels, h_blocks: int, w_blocks: int):
  """The mtf net on blocked images; returns (loss, list of SGD update ops)."""
  dim = mtf.Dimension
  spatial = [dim("batch", BATCH), dim("hb", h_blocks), dim("wb", w_blocks),
             dim("h", HEIGHT // h_blocks), dim("w", WIDTH // w_blocks)]
  channel_dims = [dim("c%d" % i, c) for i, c in enumerate(CHANNELS)]
  x = mtf.import_tf_tensor(mesh, to_blocks(images, h_blocks, w_blocks), spatial + channel_dims[:1])
  y = mtf.import_tf_tensor(mesh, to_blocks(target, h_blocks, w_blocks), spatial + channel_dims[-1:])
  for i, kernel in enumerate(kernels):
    filter_shape = [dim("fh", FILTER), dim("fw", FILTER)] + channel_dims[i:i + 2]
    w = mtf.get_variable(mesh, "kernel_%d" % i, filter_shape, initializer=tf.constant_initializer(kernel))
    x = mtf.halo_exchange(x, spatial[1], spatial[3], FILTER // 2)  # rows from the blocks above/below
    x = mtf.halo_exchange(x, spatial[2], spatial[4], FILTER // 2)  # columns from left/right blocks
    x = mtf.Conv2dOperation(x, w, [1, 1, 1, 1], "VALID").outputs[0]
    if i < len(kernels) - 1:
      x = mtf.relu(x)
  loss = mtf.reduce_mean(mtf.square(x - y))
  variables = mesh.graph.trainable_variables
  grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
  return loss, [mtf.assign_sub(v, g * LEARNING_RATE) for v, g in zip(variables, grads)]


def build_single_device(images, target, kernels):
  """The same net in plain TF on whole images with SAME convs; returns (loss, SGD update op)."""
  x = tf.constant(images)
  variables = [tf.get_variable("reference_kernel_%d" % i, initializer=k) for i, k in enumerate(kernels)]
  for i, w in enumerate(variables):
    x = tf.nn.conv2d(x, w, [1, 1, 1, 1], "SAME")
    if i < len(variables) - 1:
      x = tf.nn.relu(x)
  loss = tf.reduce_mean(tf.square(x - target))
  grads = tf.gradients(loss, variables)
  return loss, tf.group([tf.assign_sub(v, g * LEARNING_RATE) for v, g in zip(variables, grads)])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mesh_shape", default="b:2;rows:2;cols:2")
  parser.add_argument("--layout", default="batch:b;hb:rows;wb:cols")
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args()
  mesh_shape = mtf.convert_to_shape(args.mesh_shape)

  rng = np.random.RandomState(0)
  images, target = synthetic_data(rng)
  kernels = initial_kernels(rng)
  with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "spatial_mesh")
    loss, updates = build_partitioned(mesh, images, target, kernels, h_blocks=2, w_blocks=2)
    mesh_impl = mtf.placement_mesh_impl.PlacementMeshImpl(
        mesh_shape, args.layout, ["cpu:%d" % i for i in range(mesh_shape.size)])
    lowering = mtf.Lowering(graph, {mesh: mesh_impl})
    tf_loss = lowering.export_to_tf_tensor(loss)
    tf_update = tf.group([lowering.lowered_operation(op) for op in updates])
    ref_loss, ref_update = build_single_device(images, target, kernels)
    init_ops = [tf.global_variables_initializer(), lowering.copy_masters_to_slices()]

    config = tf.ConfigProto(device_count={"CPU": mesh_shape.size})
    with tf.Session(config=config) as sess:
      for op in init_ops:
        sess.run(op)
      print(f"mesh {mesh_shape}, layout {args.layout!r}")
      for step in range(args.steps):
        # Loss and update in separate runs, so no variable is read while it is being written.
        partitioned, single = sess.run([tf_loss, ref_loss])
        print(f"step {step}: spatially partitioned loss {partitioned:.6f}   single-device loss {single:.6f}")
        np.testing.assert_allclose(partitioned, single, rtol=1e-4)
        sess.run([tf_update, ref_update])
  print("OK: the spatially partitioned loss equals the single-device loss at every step.")


if __name__ == "__main__":
  main()
