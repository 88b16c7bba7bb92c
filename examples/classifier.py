"""Trains a one-hidden-layer image classifier on 8 virtual CPU devices under three layouts.

The same mtf graph is lowered three ways -- data-parallel, model-parallel and 2-D -- and the
per-step losses agree: a layout changes where the computation runs, never what it computes.
The images are synthetic 8x8 glyphs (10 classes, jittered and noisy), generated here, so the
example needs no downloads. It checks two things and prints a verdict for each: the layouts'
losses agree (within --tolerance), and the loss falls (by 1% a step, up to a half; from 5 steps).

    python examples/classifier.py [--steps 60] [--learning_rate 0.5]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import tensorflow as tf2
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf

NUM_DEVICES = 8
IMAGE_SIZE = 8
NUM_CLASSES = 10
MIN_STEPS_TO_CHECK_LEARNING = 5

# name -> (mesh shape, layout rules)
LAYOUTS = {
    "data-parallel": ("all:8", "batch:all"),
    "model-parallel": ("all:8", "hidden:all"),
    "2-D": ("rows:2;cols:4", "batch:rows;hidden:cols"),
}


def make_dataset(num_examples: int, seed: int = 0):
  """Synthetic glyphs: a fixed random stroke pattern per class, shifted by up to a pixel, plus noise."""
  rng = np.random.RandomState(seed)
  templates = (rng.uniform(size=(NUM_CLASSES, IMAGE_SIZE, IMAGE_SIZE)) < 0.3).astype(np.float32)
  labels = rng.randint(NUM_CLASSES, size=num_examples).astype(np.int32)
  images = templates[labels]
  shifts = rng.randint(-1, 2, size=(num_examples, 2))
  images = np.stack([np.roll(img, tuple(s), axis=(0, 1)) for img, s in zip(images, shifts)])
  images = images + rng.normal(scale=0.3, size=images.shape).astype(np.float32)
  return images.reshape(num_examples, IMAGE_SIZE * IMAGE_SIZE).astype(np.float32), labels


def build_train_step(mesh, images, labels, batch_size: int, hidden_size: int, learning_rate: float):
  """The mtf model: relu(x @ w1) @ w2, softmax cross-entropy, one SGD step.

  Returns (mean loss, accuracy, list of Assign operations updating the weights).
  """
  batch = mtf.Dimension("batch", batch_size)
  pixels = mtf.Dimension("pixels", IMAGE_SIZE * IMAGE_SIZE)
  hidden = mtf.Dimension("hidden", hidden_size)
  classes = mtf.Dimension("classes", NUM_CLASSES)

  x = mtf.import_tf_tensor(mesh, images, shape=[batch, pixels])
  y = mtf.import_tf_tensor(mesh, labels, shape=[batch])
  w1 = mtf.get_variable(mesh, "w1", [pixels, hidden],
                        initializer=tf.random_normal_initializer(stddev=0.1, seed=1))
  w2 = mtf.get_variable(mesh, "w2", [hidden, classes],
                        initializer=tf.random_normal_initializer(stddev=0.1, seed=2))
  h = mtf.relu(mtf.einsum([x, w1], output_shape=[batch, hidden]))
  logits = mtf.einsum([h, w2], output_shape=[batch, classes])
  on_target = mtf.reduce_sum(logits * mtf.one_hot(y, classes), reduced_dim=classes)
  loss = mtf.reduce_mean(mtf.reduce_logsumexp(logits, classes) - on_target)
  correct = mtf.cast(mtf.equal(mtf.argmax(logits, classes), y), tf.float32)
  accuracy = mtf.reduce_mean(correct)

  variables = mesh.graph.trainable_variables
  grads = mtf.gradients([loss], [v.outputs[0] for v in variables])
  updates = mtf.optimize.SgdOptimizer(learning_rate).apply_grads(grads, variables)
  return loss, accuracy, updates


def train(mesh_shape: str, layout: str, steps: int, batch_size: int = 64, hidden_size: int = 128,
          learning_rate: float = 0.5, seed: int = 0):
  """Trains from the same initial weights and batches; returns (losses per step, final accuracy)."""
  images, labels = make_dataset(steps * batch_size, seed)
  with tf.Graph().as_default():
    tf.set_random_seed(seed)
    images_ph = tf.placeholder(tf.float32, [batch_size, IMAGE_SIZE * IMAGE_SIZE])
    labels_ph = tf.placeholder(tf.int32, [batch_size])
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "classifier_mesh")
    loss, accuracy, updates = build_train_step(
        mesh, images_ph, labels_ph, batch_size, hidden_size, learning_rate)
    mesh_impl = mtf.placement_mesh_impl.PlacementMeshImpl(
        mesh_shape, layout, ["cpu:%d" % i for i in range(mtf.convert_to_shape(mesh_shape).size)])
    lowering = mtf.Lowering(graph, {mesh: mesh_impl})
    tf_loss = lowering.export_to_tf_tensor(loss)
    tf_accuracy = lowering.export_to_tf_tensor(accuracy)
    tf_update = tf.group([lowering.lowered_operation(u) for u in updates])
    config = tf.ConfigProto(device_count={"CPU": NUM_DEVICES})
    losses = []
    with tf.Session(config=config) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(lowering.copy_masters_to_slices())
      for step in range(steps):
        feed = {images_ph: images[step * batch_size:(step + 1) * batch_size],
                labels_ph: labels[step * batch_size:(step + 1) * batch_size]}
        step_loss, step_accuracy, _ = sess.run([tf_loss, tf_accuracy, tf_update], feed)
        losses.append(float(step_loss))
  return losses, float(step_accuracy)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--learning_rate", type=float, default=0.5)
  parser.add_argument("--tolerance", type=float, default=1e-4,
                      help="largest allowed loss difference between layouts")
  args = parser.parse_args(argv)
  tf.logging.set_verbosity(tf.logging.ERROR)

  curves, accuracies = {}, {}
  for name, (mesh_shape, layout) in LAYOUTS.items():
    start = time.time()
    curves[name], accuracies[name] = train(mesh_shape, layout, args.steps,
                                           learning_rate=args.learning_rate)
    print(f"trained {name:15s} mesh={mesh_shape:14s} layout={layout:24s} "
          f"in {time.time() - start:5.1f}s; final accuracy {accuracies[name]:.2f}")

  names = list(LAYOUTS)
  print("\nstep  " + "  ".join(f"{n:>15s}" for n in names))
  for step in range(args.steps):
    if step % 5 == 0 or step == args.steps - 1:
      print(f"{step:4d}  " + "  ".join(f"{curves[n][step]:15.6f}" for n in names))
  worst = max(abs(curves[n][s] - curves[names[0]][s]) for n in names for s in range(args.steps))
  agree = worst <= args.tolerance
  print(f"\nlayouts agree:  largest loss difference {worst:.2e} "
        f"(tolerance {args.tolerance:g})  {'OK' if agree else 'FAILED'}")
  learned = check_learning(curves[names[0]])
  print(f"model learns:   {learned}")
  if not agree or learned.startswith("FAILED"):
    print("FAILED: " + ("the layouts disagree" if not agree else "the loss did not fall as expected"))
    return 1
  print("OK: all three layouts trace the same loss curve")
  return 0


def expected_loss_drop(steps: int) -> float:
  """The fraction by which the loss must fall in `steps` steps: 1% a step, up to one half.

  At the default settings the loss falls by about 2% a step at first and by over 80% in 60 steps.
  """
  return min(0.5, 0.01 * steps)


def check_learning(losses: list) -> str:
  """A verdict on the loss curve, scaled to its length; starts with OK, FAILED or 'not checked'."""
  if len(losses) < MIN_STEPS_TO_CHECK_LEARNING:
    return f"not checked (needs at least {MIN_STEPS_TO_CHECK_LEARNING} steps)"
  bound = losses[0] * (1 - expected_loss_drop(len(losses)))
  verdict = "OK" if losses[-1] <= bound else "FAILED"
  return (f"{verdict}: loss fell from {losses[0]:.3f} to {losses[-1]:.3f} "
          f"(expected at most {bound:.3f} after {len(losses)} steps)")

if __name__ == "__main__":
  cpus = tf2.config.list_physical_devices("CPU")
  tf2.config.set_logical_device_configuration(
      cpus[0], [tf2.config.LogicalDeviceConfiguration()] * NUM_DEVICES)
  sys.exit(main())
