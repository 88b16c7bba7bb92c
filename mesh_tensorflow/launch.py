"""python -m mesh_tensorflow.launch --num_processes N [--devices_per_process M] -- python script.py ...

Runs N copies of the command as the tasks of one TensorFlow cluster on loopback ports (each with
its TF_CONFIG), prefixes every output line with the task's rank, stops all tasks when one fails and
exits with its status (with --max_restarts K: starts them all again, resuming from their latest
checkpoint, up to K times). With TF_CONFIG already set (a real cluster's scheduler), runs the command
once as that task. See docs/multi_process.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from mesh_tensorflow._launch.launcher import Launch, free_ports, tf_configs  # noqa: F401

USAGE = ("%(prog)s --num_processes N [--devices_per_process M] [--timeout S] [--max_restarts K "
         "[--checkpoint_dir DIR]] -- command [arg ...]")
EXAMPLE = ("example: %(prog)s --num_processes 2 --devices_per_process 4 -- python train.py\n"
           "(a command starting with `python` runs with the launcher's own interpreter)")


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Parses the launcher's flags (before '--') and runs the command after it; returns the status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  command = argv[argv.index("--") + 1:] if "--" in argv else []
  flags = argv[:argv.index("--")] if "--" in argv else argv
  parser = argparse.ArgumentParser(prog="python -m mesh_tensorflow.launch", usage=USAGE,
                                   description=__doc__.split("\n", 2)[2], epilog=EXAMPLE,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--num_processes", type=int, required=True, metavar="N", help="tasks to start")
  parser.add_argument("--devices_per_process", type=int, default=1, metavar="M",
                      help="devices each task gives the mesh (virtual CPUs, or GPUs)")
  parser.add_argument("--timeout", type=float, default=None, metavar="S",
                      help="seconds a collective waits for a lost peer before failing (default 60)")
  parser.add_argument("--max_restarts", type=int, default=0, metavar="K",
                      help="when a task fails, stop all and start them again (they resume from their "
                           "latest checkpoint), at most K times; none before any task finished a step")
  parser.add_argument("--checkpoint_dir", default=None, metavar="DIR",
                      help="where the tasks' checkpoints are (named in the restart lines)")
  args = parser.parse_args(flags)
  if not command:
    parser.error("no command: put it after '--', e.g. -- python train.py")
  return Launch(command, args.num_processes, args.devices_per_process, args.timeout,
                max_restarts=args.max_restarts, checkpoint_dir=args.checkpoint_dir).run()


if __name__ == "__main__":
  sys.exit(main())
