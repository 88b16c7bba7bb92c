"""The shipped gin models built by the original 0.1.21 and by ours from ONE checkpoint agree.

For each model family, tests/differential/probe.py runs under the original (which initialises the
model from a seed and writes the checkpoint) and then under ours (which restores that checkpoint);
both record the logits and loss of a training step, every variable's gradient, every variable
as restored and after one optimizer step, and greedy / beam decodes. Sizes are shrunk with gin bindings. The
0.1.21 wheel ships no models/*.gin, so the model files are this repository's (upstream's sizes
and layer lists); transparent_attention.gin is the original's own shipped file.

Runs only where the original is installed (`bash scripts/setup_original.sh`); CI does not run it.
"""

from __future__ import annotations

import concurrent.futures
import pathlib

import numpy as np
import pytest

from tests.differential import sides

sides.skip_unless_installed()

MODELS = sides.ROOT / "mesh_tensorflow" / "transformer" / "gin" / "models"
TOLERANCE = 1e-5
SMALL = ["num_layers = 2", "d_model = 16", "d_ff = 32", "num_heads = 2", "d_kv = 8", "dropout_rate = 0.0"]
# Deterministic top-2 gating ("random" draws), 4 experts, groups that fit the 4x8 batch.
MOE = ["moe.MoE1D.num_experts = 4", "moe.MoE1D.group_size = 8", "moe.MoE1D.second_policy_train = 'all'",
       "moe.MoE1D.second_policy_eval = 'all'"]
# 2 blocks of (attention, feed-forward) encoder layers and of (self-, enc-dec-attention, ff) decoder ones.
TRANSPARENT = ["TransparentEncDecAttention.encoder_num_modules = 2",
               "TransparentEncDecAttention.layers_per_encoder_module = 2",
               "TransparentEncDecAttention.decoder_num_modules = 2",
               "TransparentEncDecAttention.layers_per_decoder_module = 3",
               "TransparentEncDecAttention.dropout_rate = 0.0", "make_layer_stack.num_layers = 2"]

# family: (gin files, extra bindings, optimizer, mesh shape, mode of the loss and gradients).
# lm_moe runs in eval mode: the original's top-2 gating in train mode casts `importance`, which an
# LM without padding info passes as None (moe.py _top_2_gating: AttributeError on None.dtype).
FAMILIES = {
    "lm": ([MODELS / "lm_base.gin"], [], "adafactor", "", "train"),
    "bitransformer": ([MODELS / "bi_base.gin"], [], "adafactor", "", "train"),
    "lm_moe": ([MODELS / "lm_moe.gin"], MOE, "adafactor", "", "eval"),
    "bi_moe": ([MODELS / "bi_moe.gin"], MOE, "adafactor", "", "train"),
    "lm_adam": ([MODELS / "lm_base.gin"], [], "adam", "", "train"),
    "transparent_attention": (
        [MODELS / "bi_base.gin",
         sides.ORIGINAL / "mesh_tensorflow" / "transformer" / "gin" / "transparent_attention.gin"],
        TRANSPARENT, "adafactor", "", "train"),
    "bitransformer_2x2_mesh": ([MODELS / "bi_base.gin"], [], "adafactor", "batch:2;model:2", "train"),
}


def probe_args(family: str, folder: pathlib.Path, side: str) -> list:
  files, bindings, optimizer, mesh_shape, mode = FAMILIES[family]
  args = [f"--gin_file={f}" for f in files] + [f"--gin_param={b}" for b in SMALL + bindings]
  args += [f"--optimizer={optimizer}", f"--mode={mode}", f"--mesh_shape={mesh_shape}",
           f"--checkpoint={folder / 'model.ckpt'}", f"--out={folder / (side + '.npz')}"]
  return args + (["--write"] if side == "original" else [])


def run_family(family: str, folder: pathlib.Path) -> dict:
  """{side: {key: array}}, or the exception of the side that failed."""
  folder.mkdir(parents=True)
  results = {}
  for side in sides.SIDES:   # the original first: it writes the checkpoint
    sides.run(side, "probe.py", probe_args(family, folder, side))
    with np.load(folder / f"{side}.npz") as data:
      results[side] = dict(data)
  return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
  """Every family's results, two families at a time (one subprocess pair each); prints the table."""
  root = tmp_path_factory.mktemp("differential")
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    futures = {f: pool.submit(run_family, f, root / f) for f in FAMILIES}
  out = {}
  for family, future in futures.items():
    try:
      out[family] = future.result()
    except RuntimeError as error:
      out[family] = error
  print("\nmax |original - ours| per family (logits, loss, gradients, post-step variables; decodes equal?)")
  for family, found in out.items():
    if isinstance(found, Exception):
      print(f"  {family}: FAILED: {str(found).splitlines()[0]}")
      continue
    row = {group: max_difference(found, group) for group in ("logits", "loss", "grad/", "step/")}
    decodes = all(np.array_equal(found["original"][k], found["ours"].get(k))
                  for k in found["original"] if k.startswith("decode/"))
    numbers = ", ".join(f"{group.rstrip('/')} {difference:.2e}" for group, difference in row.items())
    print(f"  {family}: {numbers}, decodes equal: {decodes}")
  return out


def of(results: dict, family: str) -> dict:
  found = results[family]
  if isinstance(found, Exception):
    raise found
  return found


def keys(found: dict, prefix: str) -> list:
  """The original's keys starting with `prefix`; ours must have the same ones."""
  original = sorted(k for k in found["original"] if k.startswith(prefix))
  ours = sorted(k for k in found["ours"] if k.startswith(prefix))
  assert original == ours, f"keys differ: only original {sorted(set(original) - set(ours))}, " \
                           f"only ours {sorted(set(ours) - set(original))}"
  assert original, f"no {prefix!r} results"
  return original


def max_difference(found: dict, prefix: str) -> float:
  both = [k for k in found["original"] if k.startswith(prefix) and k in found["ours"]]
  return max((float(np.max(np.abs(found["original"][k] - found["ours"][k]))) for k in both
              if found["original"][k].shape == found["ours"][k].shape), default=float("nan"))


def assert_close(found: dict, prefix: str):
  for key in keys(found, prefix):
    original, ours = found["original"][key], found["ours"][key]
    np.testing.assert_allclose(ours, original, rtol=TOLERANCE, atol=TOLERANCE, err_msg=key)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_loss_match_the_original(results, family):
  found = of(results, family)
  assert_close(found, "logits")
  assert_close(found, "loss")
  assert found["original"]["logits"].shape[-1] == 128   # the vocabulary, padded to vocab_divisor


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_of_every_variable_match_the_original(results, family):
  assert_close(of(results, family), "grad/")


@pytest.mark.parametrize("family", FAMILIES)
def test_variables_after_one_optimizer_step_match_the_original(results, family):
  found = of(results, family)
  assert_close(found, "step/")
  for key in keys(found, "step/"):   # the step moved each variable that has a gradient
    if np.any(found["original"].get("grad/" + key[len("step/"):], 0) != 0):
      assert not np.array_equal(found["original"][key], found["original"]["init/" + key[len("step/"):]]), key


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_and_beam_decodes_equal_the_original(results, family):
  found = of(results, family)
  for key in keys(found, "decode/"):
    np.testing.assert_array_equal(found["ours"][key], found["original"][key], err_msg=key)
