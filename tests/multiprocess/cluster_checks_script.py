"""One launch for the checks of test_collectives_between_processes.py and test_multi_process.py.

Each task runs every collective and halo exchange case of collectives_script.py (writing
<out>/rank<R>.npz), then trains as train_script.py does with the same flags (writing
<out>/rank<R>.json), so a cluster shape costs one TensorFlow import and one server per task for
both test files.
"""

from __future__ import annotations

import argparse

import tensorflow.compat.v1 as tf

from mesh_tensorflow.collective_mesh_impl import Cluster
from tests.multiprocess import collectives_script, train_script


def main():
  parser = argparse.ArgumentParser()
  train_script.add_flags(parser)
  args = parser.parse_args()
  tf.disable_eager_execution()
  cluster = Cluster.from_tf_config()
  collectives_script.save_cases(cluster, args.out)
  train_script.train_as_flagged(cluster, args)


if __name__ == "__main__":
  main()
