"""Plans Transformer LMs on TPU v3 and H100 pods: data parallelism against the best layout found.

    python benchmarks/plan_pods.py [--accelerators tpu_v3,h100] [--check]

For each model (1B on 8 processors, 10B on 64, 100B on 512) it costs, with `mtf.cost_model` and
the accelerator preset, data parallelism and a family of 2-D layouts (batch over one mesh
dimension, d_ff / heads / vocab over the other, each mesh shape b x m), with and without layer
rematerialisation, and prints a Markdown table: predicted tokens/s, utilisation of peak FLOP/s and
the fit verdict for data parallelism and for the fastest layout that fits.

The layers of a Transformer are identical, so every per-processor cost (FLOPs, collectives,
variable and optimizer bytes, the activation peak) is affine in the number of layers: the script
costs 1 and 2 layers and extrapolates to the full depth (`mtf.auto_mtf.depth`), which keeps
pod-scale planning to minutes on a laptop. `--check` compares the extrapolation with a full
costing at 3 layers.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import gin
import tensorflow.compat.v1 as tf

import mesh_tensorflow as mtf
from mesh_tensorflow._explain.transformer_graph import build_transformer_graph
from mesh_tensorflow.auto_mtf import depth

LENGTH, VOCAB, D_KV = 1024, 32768, 128
# name: (layers, d_model, d_ff, heads, batch, processors)
MODELS = {
  "1B": (20, 2048, 8192, 16, 32, 8),
  "10B": (32, 5120, 20480, 40, 128, 64),
  "100B": (56, 12288, 49152, 96, 512, 512),
}
SPLIT = "batch:b;d_ff:m;heads:m;vocab:m"
HEADER = "tokens/s | util. | memory"


@dataclasses.dataclass(frozen=True)
class Plan:
  """The extrapolated cost of one layout at full depth."""

  mesh: str
  layout: str
  remat: bool
  step_s: float
  flops: float
  total_bytes: float
  memory_bytes: float
  peak_flops: float
  tokens: int

  @property
  def fits(self) -> bool:
    return self.total_bytes <= self.memory_bytes

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / self.step_s

  @property
  def utilization(self) -> float:
    return self.flops / (self.step_s * self.peak_flops)


def graph_of(model: str, layers: int, remat: bool):
  _, d_model, d_ff, heads, batch, _ = MODELS[model]
  gin.clear_config()
  bindings = [
    f"num_layers = {layers}",
    f"d_model = {d_model}",
    f"d_ff = {d_ff}",
    f"num_heads = {heads}",
    f"d_kv = {D_KV}",
    f"Unitransformer.max_length = {LENGTH}",
    "get_variable_dtype.activation_dtype = 'bfloat16'",
    f"LayerStack.recompute_grads = {remat}",
  ]
  with tf.Graph().as_default():
    return build_transformer_graph(["models/lm_base.gin"], bindings, batch, LENGTH, VOCAB)


def at_depth(shallow, deep, layers: int) -> depth.DepthCost:
  """The costs of 1 and 2 layers, extrapolated to `layers` (auto_mtf.depth's exact line)."""
  return depth.DepthCost.from_reports(shallow, deep, (1, 2), layers)


def candidates(processors: int, accelerator: str) -> list:
  """Data parallelism; batch x model meshes; on 64+ processors also the sequence split 4 ways."""
  out = [(f"all:{processors}", "batch:all")]
  model_sizes = [m for m in (2, 4, 8, 16, 32) if m < processors and (accelerator != "h100" or m <= 8)]
  for m in model_sizes:  # H100: the model axis inside a host
    out.append((f"b:{processors // m};m:{m}", SPLIT))
  if processors >= 16 * model_sizes[-1]:
    m = model_sizes[-1]
    out.append((f"b:{processors // (4 * m)};s:4;m:{m}", SPLIT + ";length:s"))
  return out


def plan_model(model: str, accelerator: str) -> list:
  layers, _, _, _, batch, processors = MODELS[model]
  tm = mtf.cost_model.get_time_model(accelerator)
  plans = []
  for remat in (False, True):
    graphs = [graph_of(model, n, remat) for n in (1, 2)]
    for mesh, layout in candidates(processors, accelerator):
      try:
        reports = [mtf.cost_model.estimate_cost(g, mesh, layout, [loss], tm) for g, loss in graphs]
      except ValueError:  # the mesh dimension does not divide a dimension (heads 40 over 16)
        continue
      cost = at_depth(*reports, layers)
      plans.append(
        Plan(mesh, layout, remat, cost.step_s, cost.flops, cost.memory.total_bytes, tm.memory_bytes,
             tm.flops_per_s, batch * LENGTH)
      )
  return plans


def row(model: str, plans: list) -> str:
  layers, d_model, d_ff, heads, batch, processors = MODELS[model]
  data_parallel = min(
    (p for p in plans if p.layout == "batch:all"), key=lambda p: (not p.fits, p.step_s), default=None
  )
  fitting = [p for p in plans if p.fits]
  best = min(fitting, key=lambda p: p.step_s) if fitting else None

  def cell(p):
    verdict = "fits" if p.fits else f"**no** ({p.total_bytes / 1e9:,.0f} GB)"
    return f"{p.tokens_per_s:,.0f} | {100 * p.utilization:.0f}% | {verdict}"

  shown = best or min(plans, key=lambda p: p.total_bytes)  # nothing fits: the least memory
  best_text = f"{'' if best else 'none fits; least memory: '}`{shown.mesh}` `{shown.layout}`"
  best_text += f"{' + remat' if shown.remat else ''} | {cell(shown)}"
  shape = f"{layers} x d_model {d_model}, d_ff {d_ff}, {heads} heads; batch {batch} x {LENGTH}"
  if data_parallel is None:
    return f"| {model} | {processors} | {shape} | n/a (batch < processors) | | | {best_text} |"
  return (
    f"| {model} | {processors} | {shape} | {cell(data_parallel)}"
    f"{' + remat' if data_parallel.remat else ''} | {best_text} |"
  )


def check(accelerator: str) -> None:
  """The 1-and-2-layer extrapolation against a full costing of 3 layers (10B shapes, 64 processors)."""
  tm = mtf.cost_model.get_time_model(accelerator)
  mesh = "b:8;m:8"
  reports = [
    mtf.cost_model.estimate_cost(g, mesh, SPLIT, [loss], tm)
    for g, loss in (graph_of("10B", n, False) for n in (1, 2, 3))
  ]
  guess = at_depth(reports[0], reports[1], 3)
  terms = [(k, getattr(guess, k), getattr(reports[2], k))
           for k in ("compute_s", "comm_s", "overhead_s", "flops")]
  terms += [(k, getattr(guess.memory, k), getattr(reports[2].memory, k))
            for k in ("variable_bytes", "slot_bytes", "activation_peak_bytes", "comm_buffer_bytes")]
  for k, extrapolated, costed in terms:
    print(f"check {accelerator} {k}: extrapolated {extrapolated:.6g}, costed {costed:.6g}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--accelerators", default="tpu_v3,h100")
  parser.add_argument("--check", action="store_true")
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--batch", type=int, help="override the models' batch sizes")
  args = parser.parse_args()
  if args.batch:
    for name, (layers, d_model, d_ff, heads, _, processors) in MODELS.items():
      MODELS[name] = (layers, d_model, d_ff, heads, args.batch, processors)
  tf.disable_eager_execution()
  for accelerator in args.accelerators.split(","):
    if args.check:
      check(accelerator)
    print(f"\n{accelerator}\n")
    print(f"| model | processors | shape | data parallel: {HEADER} | best layout | {HEADER} |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
      start = time.perf_counter()
      print(
        row(model, plan_model(model, accelerator)),
        f"<!-- {time.perf_counter() - start:.0f} s -->",
        flush=True,
      )


if __name__ == "__main__":
  main()
