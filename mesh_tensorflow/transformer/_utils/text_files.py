"""Reading input lines and writing output lines (decodes, scores) with tf.io.gfile (local or remote paths)."""

from __future__ import annotations

import os
from typing import Iterable

import tensorflow.compat.v1 as tf


def get_inputs_from_file(input_filename: str, ignore_comments: bool = False) -> list[str] | None:
  """The file's lines without trailing whitespace and final empty line; None for an empty file.

  With ignore_comments, lines starting with "#" are dropped.
  """
  with tf.io.gfile.GFile(input_filename, "r") as f:
    inputs = [line.rstrip() for line in f]
  if inputs and not inputs[-1]:
    inputs.pop()
  if not inputs:
    tf.logging.info("input file %s is empty", input_filename)
    return None
  if ignore_comments:
    inputs = [line for line in inputs if not line.startswith("#")]
  return inputs


def write_lines_to_file(lines: Iterable, filename: str) -> None:
  """Writes str(line) per line (inner newlines become spaces), replacing the file (making its directory)."""
  if tf.io.gfile.exists(filename):
    tf.io.gfile.remove(filename)
  if os.path.dirname(filename):
    tf.io.gfile.makedirs(os.path.dirname(filename))
  with tf.io.gfile.GFile(filename, "w") as f:
    # One write, so that an empty list still creates the file.
    f.write("".join("%s\n" % str(line).replace("\n", " ") for line in lines))
