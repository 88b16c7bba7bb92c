"""The command line `python -m mesh_tensorflow.explain`: a layout of a gin-configured Transformer.

It builds the Transformer from gin files, so it sits above the transformer package in the layer
order, apart from `mesh_tensorflow.explain` (mtf.explain), which the package root imports.
"""

from __future__ import annotations

import argparse
import sys

from mesh_tensorflow._cost import time_model as time_model_lib
from mesh_tensorflow._explain import pipeline_search
from mesh_tensorflow._explain import search as search_lib
from mesh_tensorflow._explain.transformer_graph import build_transformer_graph, configured_num_layers
from mesh_tensorflow.auto_mtf import api as auto_mtf_api
from mesh_tensorflow.explain import __doc__ as USAGE
from mesh_tensorflow.explain import explain


def _search_deep(args, bindings: list) -> None:
  """--search on a Transformer deeper than the search depths: built at those, costs extrapolated."""
  import gin
  import tensorflow.compat.v1 as tf

  def build(num_layers: int, outer_batch_size: int = 1) -> tuple:
    gin.clear_config()
    with tf.Graph().as_default():
      graph, loss = build_transformer_graph(
        args.gin_file, [*bindings, f"num_layers = {num_layers}"], args.batch, args.length, args.vocab_size,
        outer_batch_size=outer_batch_size,
      )
    return graph, [loss]

  num_layers = configured_num_layers(args.gin_file, bindings)
  time_model = time_model_lib.get_time_model(args.time_model)
  tokens = args.batch * args.length
  search_lib.search_deep_model(build, num_layers, args.mesh_shape, time_model, tokens_per_step=tokens)
  if args.pipeline_search:
    from mesh_tensorflow.transformer import utils

    processors = mtf_shape_size(args.mesh_shape)
    found = pipeline_search.candidates(build, num_layers, processors, time_model, args.batch, args.length,
                                       utils.get_variable_dtype().activation_dtype.size)
    pipeline_search.print_search(found, tokens)


def mtf_shape_size(mesh_shape) -> int:
  from mesh_tensorflow._core.dims import convert_to_shape

  return convert_to_shape(mesh_shape).size


def main(argv=None) -> int:
  """The command line: explains a layout of a gin-configured Transformer's training step."""
  parser = argparse.ArgumentParser(
    prog="python -m mesh_tensorflow.explain",
    description=USAGE,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("--gin_file", action="append", default=[], help="gin file (package-relative or a path)")
  parser.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. 'd_model = 64'")
  parser.add_argument("--mesh_shape", required=True)
  parser.add_argument("--layout", help="layout rules (required unless --search)")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--length", type=int, default=32)
  parser.add_argument("--vocab_size", type=int, default=256)
  presets = sorted(time_model_lib.PRESETS)
  parser.add_argument("--time_model", "--accelerator", dest="time_model", default="cpu", choices=presets)
  parser.add_argument("--search", action="store_true", help="search the layout within the memory limit")
  parser.add_argument("--remat", action="store_true", help="rematerialise every layer on the backward pass")
  parser.add_argument("--no_pipeline_search", dest="pipeline_search", action="store_false",
                      help="with --search on a deep model: skip the pipelined layouts (stage:S x the mesh's "
                           "processors)")
  parser.add_argument("--plot_dir", default=None)
  parser.add_argument("--plot_format", default="png", choices=["png", "svg"])
  args = parser.parse_args(argv)
  if not args.search and not args.layout:
    parser.error("give --layout, or --search to find one")
  bindings = args.gin_param + (["LayerStack.recompute_grads = True"] if args.remat else [])
  if args.search and configured_num_layers(args.gin_file, bindings) > search_lib.SEARCH_DEPTHS[1]:
    _search_deep(args, bindings)  # plan a deep model from two shallow copies of it
    return 0
  graph, loss = build_transformer_graph(args.gin_file, bindings, args.batch, args.length, args.vocab_size)
  layout = args.layout
  if args.search:
    time_model = time_model_lib.get_time_model(args.time_model)
    rules = auto_mtf_api.layout(
      graph, args.mesh_shape, [loss], memory_limit_bytes=time_model.memory_bytes, time_model=time_model
    )
    layout = ";".join(f"{d}:{m}" for d, m in rules)
    print(f"searched layout: {layout or '(replicated)'}")
  try:
    explanation = explain(
      graph,
      args.mesh_shape,
      layout,
      [loss],
      args.time_model,
      plot_dir=args.plot_dir,
      plot_format=args.plot_format,
      tokens_per_step=args.batch * args.length,
    )
  except ImportError as e:
    print(e, file=sys.stderr)
    return 1
  for path in explanation.pictures:
    print(f"wrote {path}")
  _print_pipeline_schedule(graph)
  return 0


def _print_pipeline_schedule(graph) -> None:
  """For a pipelined layer stack (gin LayerStack.pipeline_stages): its pipeline line and picture."""
  import math

  import gin

  from mesh_tensorflow._ops.pipeline_schedule import pipeline_schedule

  def query(name, default):
    try:
      return gin.query_parameter(f"transformer.LayerStack.{name}")
    except ValueError:
      return default

  blocks = {math.prod(d.size for d in v.stack_dims) for v in graph.all_variables if v.is_layer_stack}
  if not blocks:
    return
  sched = pipeline_schedule(max(blocks), query("pipeline_stages", 1), query("num_microbatches", 1),
                            query("pipeline_schedule", "fill_drain"), query("layers_per_stage_per_round", 1))
  print(pipeline_search.pipeline_line(sched))
  print(sched.picture(pipeline_search.MAX_PICTURE_TICKS))
