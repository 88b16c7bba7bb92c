"""train_script.py's 2-d layout, --steps steps in all, resuming from --ckpt_dir's latest checkpoint.

The command a launch with --max_restarts starts again as it is: each start trains only the steps
its checkpoint lacks (test_restarts.py).
"""

from __future__ import annotations

import argparse

import tensorflow.compat.v1 as tf

from mesh_tensorflow.collective_mesh_impl import Cluster
from tests.multiprocess import train_script


def steps_done(ckpt_dir: str) -> int:
  latest = tf.train.latest_checkpoint(ckpt_dir)
  return int(latest.rsplit("-", 1)[1]) if latest else 0


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, required=True)
  parser.add_argument("--ckpt_dir", required=True)
  args = parser.parse_args()
  tf.disable_eager_execution()
  train_script.train(*train_script.LAYOUTS["2d"], args.steps - steps_done(args.ckpt_dir),
                     Cluster.from_tf_config(), args.ckpt_dir, restore=True)


if __name__ == "__main__":
  main()
