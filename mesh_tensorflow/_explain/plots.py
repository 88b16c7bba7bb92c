"""Pictures of a layout: how tensors are tiled over the mesh, and communication per layer (matplotlib)."""

from __future__ import annotations

import collections
import os

import numpy as np

from mesh_tensorflow._core.dims import convert_to_shape
from mesh_tensorflow._core.layout import processor_coordinates_to_pnum


def _pyplot():
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as e:
    raise ImportError(
      "Drawing layouts needs matplotlib: pip install 'mesh-tensorflow[plot]' "
      "(the text explanation works without it)."
    ) from e
  return plt


def owner_grid(tensor_shape, mesh_shape, layout_rules) -> np.ndarray:
  """For the first two dims of a tensor (one block per split), the lowest processor holding each block."""
  dims = list(tensor_shape.dims)[:2] + [None] * max(0, 2 - len(tensor_shape.dims))
  axes = [None if d is None else layout_rules.tensor_dimension_to_mesh_axis(d, mesh_shape) for d in dims]
  blocks = [1 if a is None else mesh_shape[a].size for a in axes]
  grid = np.zeros(blocks, dtype=int)
  for i in range(blocks[0]):
    for j in range(blocks[1]):
      coords = [0] * mesh_shape.ndims
      for axis, k in zip(axes, (i, j)):
        if axis is not None:
          coords[axis] = k
      grid[i, j] = processor_coordinates_to_pnum(mesh_shape, coords)
  return grid


def split_summary(tensor_shape, mesh_shape, layout_rules) -> str:
  """Which dims the layout splits over which mesh dims ("d_ff→model"), or "nothing split"."""
  splits = []
  for d in tensor_shape.dims:
    axis = layout_rules.tensor_dimension_to_mesh_axis(d, mesh_shape)
    if axis is not None:
      splits.append(f"{d.name}→{mesh_shape.dims[axis].name}")
  return ", ".join(splits) or "nothing split"


def layer_of(op_name: str) -> str:
  """The layer an op belongs to: its name up to the second "/" (gradients join their forward layer)."""
  return "/".join(op_name.split("/")[:2])


def comm_bytes_per_layer(events) -> dict:
  out = collections.Counter()
  for e in events:
    out[layer_of(e.op_name)] += e.bytes_per_processor
  return dict(out)


def draw(report, tensors, directory: str, fmt: str = "png") -> list:
  """Writes tiling.<fmt> (each tensor's blocks coloured by owner, titled with its splits; a tensor
  split nowhere says so) and comm_per_layer.<fmt>; returns paths."""
  plt = _pyplot()
  os.makedirs(directory, exist_ok=True)
  mesh_shape = convert_to_shape(report.mesh_shape)
  fig, axes = plt.subplots(1, max(1, len(tensors)), figsize=(3 * max(1, len(tensors)), 3), squeeze=False)
  for ax, t in zip(axes[0], tensors):
    splits = split_summary(t.shape, mesh_shape, report.layout_rules)
    ax.set_title(f"{t.name}\n{t.shape}\n{splits}", fontsize=7)
    if splits == "nothing split":  # one block: say so instead of a solid square labelled 0
      ax.set_facecolor("0.9")
      ax.text(0.5, 0.5, f"nothing split:\nall {mesh_shape.size} processors\nhold all of it",
              ha="center", va="center", fontsize=8, transform=ax.transAxes)
      ax.set_xticks([])
      ax.set_yticks([])
    else:
      grid = owner_grid(t.shape, mesh_shape, report.layout_rules)
      ax.imshow(grid, cmap="tab20", vmin=0, vmax=19)
      ax.set_yticks(range(grid.shape[0]))  # one tick per block, not matplotlib's fractional ones
      ax.set_xticks(range(grid.shape[1]))
    names = t.shape.dimension_names + ["", ""]
    ax.set_ylabel(names[0])
    ax.set_xlabel(names[1])
  tiling = os.path.join(directory, f"tiling.{fmt}")
  fig.tight_layout()
  fig.savefig(tiling)
  plt.close(fig)
  per_layer = comm_bytes_per_layer(report.events)
  fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(per_layer)), 3))
  ax.bar(range(len(per_layer)), list(per_layer.values()))
  ax.set_xticks(range(len(per_layer)))
  ax.set_xticklabels(list(per_layer), rotation=60, ha="right", fontsize=6)
  ax.set_ylabel("bytes sent per processor")
  comm = os.path.join(directory, f"comm_per_layer.{fmt}")
  fig.tight_layout()
  fig.savefig(comm)
  plt.close(fig)
  return [tiling, comm]
