"""Starts this task's TensorFlow server and prints the addresses it listens on.

    python scripts/listening_addresses.py

Without TF_CONFIG it launches itself as the 2 tasks of a loopback cluster (as `python -m
mesh_tensorflow.launch --num_processes 2` would); with it (a real cluster's task) it checks that
task. Each task prints its address in the cluster and what the operating system says its server
listens on; `[::]` or `0.0.0.0` is every interface of the machine, reachable from its networks.
"""

from __future__ import annotations

import sys

import tensorflow.compat.v1 as tf

from mesh_tensorflow._launch.cluster import Cluster, listening_addresses
from mesh_tensorflow.launch import Launch


def main() -> int:
  tf.disable_eager_execution()
  cluster = Cluster.from_tf_config()
  if cluster is None:
    return Launch([sys.executable, __file__], 2).run()
  cluster.server()
  address = cluster.workers[cluster.task_index]
  listening = listening_addresses(int(address.rsplit(":", 1)[1]))
  everywhere = any(a.startswith(("[::]:", "0.0.0.0:")) for a in listening)
  print(f"task {cluster.task_index}: cluster address {address}, listening on {', '.join(listening)}"
        f"{' (every interface)' if everywhere else ''}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
