"""Kills one task of a 2-process run again and again; counts how the survivor reports it.

Each round starts two tasks of tests/multiprocess/train_script.py by hand (no launcher, so the
survivor learns of the loss only from its own collectives), task 1 SIGKILLs itself at step 1,
and the survivor's output is classified: `LostPeerError` naming task 1 (the documented outcome),
another LostPeerError, or anything else (a raw TensorFlow error). Exits non-zero unless every
round gave a LostPeerError.

    python scripts/lost_peer_loop.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.multiprocess.launching import kill_a_peer_without_launcher  # noqa: E402


def classify(survivor_output: str) -> str:
  if "LostPeerError: Lost task 1 (" in survivor_output:
    return "LostPeerError naming task 1"
  if "LostPeerError" in survivor_output:
    return "LostPeerError without the task"
  lines = [line for line in survivor_output.splitlines() if "Error" in line]
  return "other: " + (lines[-1][:160] if lines else survivor_output[-160:])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=30)
  args = parser.parse_args(argv)
  outcomes = collections.Counter()
  for round_number in range(1, args.rounds + 1):
    with tempfile.TemporaryDirectory() as out_dir:
      output, _, killed_status = kill_a_peer_without_launcher(out_dir)
    outcome = classify(output) if killed_status == -9 else f"task 1 exited with {killed_status}"
    outcomes[outcome] += 1
    print(f"round {round_number}: {outcome}", flush=True)
  print("\n".join(f"{count:3d}  {outcome}" for outcome, count in outcomes.most_common()))
  return 0 if sum(c for o, c in outcomes.items() if o.startswith("LostPeerError")) == args.rounds else 1


if __name__ == "__main__":
  sys.exit(main())
