"""A checkpoint the original 0.1.21 wrote restores into our pipelined Transformer (issue #34: a
pipelined model keeps the unpipelined variable names and shapes).

The original writes the checkpoint of a 4-block decoder LM (tests/differential/probe.py, as in
test_models.py: a seeded initialisation, Adafactor's slots included). Ours restores it
* in probe.py, as LayerStack(pipeline_stages=S, num_microbatches=M) on 8 virtual CPUs (whole
  masters): every variable restores exactly, the logits, loss and greedy decode equal the
  original's, and one Adafactor step gives the original's (unpipelined) variables and slots;
* through the driver (sliced masters, its CPU default): utils.run resumes a model_dir holding it,
  or warm-starts from it with init_checkpoint, under layouts/cpu8_pipeline.gin, and its first step
  (loss, saved variables) is the unpipelined run's under layouts/cpu8_dp_mp.gin.

Runs only where the original is installed (`bash scripts/setup_original.sh`); CI does not run it.
"""

from __future__ import annotations

import concurrent.futures
import pathlib
import shutil

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer import utils
from mesh_tensorflow.transformer._train import progress
from tests.differential import sides
from tests.differential.test_models import MODELS, TOLERANCE
from tests.transformer import tiny_run

sides.skip_unless_installed()

# 4 alike blocks (2 or 4 stages divide them); heads, d_ff and the byte vocabulary (259, padded to
# 384) divide over model:4, so the driver's tiny run (tests/transformer/tiny_run.py) is this model.
MODEL = ["num_layers = 4", "d_model = 16", "d_ff = 32", "num_heads = 4", "d_kv = 4", "dropout_rate = 0.0",
         "Unitransformer.max_length = 16"]
VOCAB_SIZE = 259
# name: (mesh shape, layout rules, LayerStack's pipeline_stages, num_microbatches, pipeline_schedule).
# The driver test below runs fill-drain on stage:2;batch:2;model:2 (layouts/cpu8_pipeline.gin).
PROBES = {
    "stage:2;batch:2;model:2 S=2 M=2 circular": (
        "stage:2;batch:2;model:2", "stages:stage;batch:batch;d_ff:model;heads:model;vocab:model",
        [2, 2, "circular"]),
    "stage:4;batch:2 S=4 M=2 fill_drain": (
        "stage:4;batch:2", "stages:stage;batch:batch", [4, 2, "fill_drain"]),
}


def probe_args(folder: pathlib.Path, out: str, mesh_shape="", layout=None, pipeline=()) -> list:
  """probe.py's arguments for MODEL, pipelined by `pipeline` (a PROBES entry's last item) if given."""
  bindings = MODEL + [f"transformer.LayerStack.{key} = {value!r}" for key, value in
                      zip(("pipeline_stages", "num_microbatches", "pipeline_schedule"), pipeline)]
  args = [f"--gin_file={MODELS / 'lm_base.gin'}"] + [f"--gin_param={b}" for b in bindings]
  args += [f"--vocab_size={VOCAB_SIZE}", "--optimizer=adafactor", "--mode=train",
           f"--mesh_shape={mesh_shape}", f"--checkpoint={folder / 'model.ckpt'}", f"--out={folder / out}"]
  return args + ([f"--layout={layout}"] if layout else [])


def load(path: pathlib.Path) -> dict:
  with np.load(path) as data:
    return dict(data)


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
  """(the checkpoint's folder, {"original" or a PROBES name: its probe results}); prints the table."""
  folder = tmp_path_factory.mktemp("pipelined_original")
  sides.run("original", "probe.py", probe_args(folder, "original.npz") + ["--write"])

  def ours(index_and_name):
    index, name = index_and_name
    sides.run("ours", "probe.py", probe_args(folder, f"ours_{index}.npz", *PROBES[name]))
    return load(folder / f"ours_{index}.npz")

  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    results = dict(zip(PROBES, pool.map(ours, enumerate(PROBES))))
  results["original"] = load(folder / "original.npz")
  print("\nmax |original - ours pipelined| (logits, loss, restored variables, after one step)")
  for name in PROBES:
    numbers = [differences(results["original"], results[name], group)
               for group in ("logits", "loss", "init/", "step/")]
    print(f"  {name}: " + ", ".join(f"{n:.2e}" for n in numbers))
  return folder, results


def differences(want: dict, got: dict, prefix: str) -> float:
  """The largest |want - got| over want's keys starting with prefix (got must have them all)."""
  keys = [k for k in want if k.startswith(prefix)]
  assert keys and all(k in got for k in keys), f"{prefix!r}: missing {sorted(set(keys) - set(got))}"
  return max(float(np.max(np.abs(want[k] - got[k]))) for k in keys)


def assert_close(want: dict, got: dict, prefix: str, tolerance: float = TOLERANCE):
  differences(want, got, prefix)
  for key in (k for k in want if k.startswith(prefix)):
    np.testing.assert_allclose(got[key], want[key], rtol=tolerance, atol=tolerance, err_msg=key)


@pytest.mark.parametrize("name", PROBES)
def test_pipelined_logits_loss_and_decode_from_the_originals_checkpoint_equal_the_originals(probed, name):
  _, results = probed
  original, ours = results["original"], results[name]
  assert_close(original, ours, "logits")
  assert_close(original, ours, "loss")
  assert original["logits"].shape[-1] == 384   # the vocabulary, padded to vocab_divisor 128
  np.testing.assert_array_equal(ours["decode/greedy"], original["decode/greedy"])


@pytest.mark.parametrize("name", PROBES)
def test_pipelined_model_restores_every_variable_of_the_originals_checkpoint(probed, name):
  folder, results = probed
  reader = tf.train.load_checkpoint(str(folder / "model.ckpt"))
  restored = {k[len("init/"):]: v for k, v in results[name].items() if k.startswith("init/")}
  assert sorted(restored) == sorted(set(reader.get_variable_to_shape_map()) - {"global_step"})
  assert any("block_003/layer_001" in k for k in restored)
  for key, value in restored.items():
    np.testing.assert_array_equal(value, reader.get_tensor(key), err_msg=key)


@pytest.mark.parametrize("name", PROBES)
def test_one_pipelined_step_from_the_originals_checkpoint_is_the_unpipelined_step(probed, name):
  """Weights and Adafactor's slots after one step equal the original's (an unpipelined model's;
  the driver test below compares with ours unpipelined)."""
  _, results = probed
  assert_close(results["original"], results[name], "step/")
  for key in (k for k in results[name] if k.startswith("step/")):   # each weight and slot moved
    assert not np.array_equal(results[name][key], results[name]["init/" + key[len("step/"):]]), key


def driver_step(model_dir: pathlib.Path, corpus: str, layout: str, **kwargs) -> tuple:
  """(loss, {checkpoint name: value}) of utils.run's first training step on model_dir under the
  packaged `layout`, with the tiny run's data; `kwargs` go to utils.run."""
  tiny_run.configure_gin(corpus, MODEL + ["utils.run.train_steps = 1",
                                          "utils.run.sequence_length = {'inputs': 8, 'targets': 8}"], layout)
  try:
    tiny_run.run(model_dir, "train", **kwargs)
  finally:
    utils.FLAGS.unparse_flags()
  [(step, loss)] = progress.read_scalars(str(model_dir), "loss")
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(model_dir)))
  assert step == 1 and reader.get_tensor("global_step") == 1
  return loss, {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def test_the_driver_resumes_and_warm_starts_pipelined_from_the_originals_checkpoint(probed, tmp_path):
  """A model_dir holding the original's checkpoint as model.ckpt-0, resumed, and a fresh one
  warm-started with init_checkpoint (its fresh slots are the checkpoint's zeros), both pipelined:
  the first step's loss and saved variables equal the unpipelined resumed run's (on
  layouts/cpu8_dp_mp.gin)."""
  folder, _ = probed
  corpus = tiny_run.write_corpus(str(tmp_path))
  original = tf.train.load_checkpoint(str(folder / "model.ckpt"))
  runs = {}
  for name, layout in [("unpipelined", "layouts/cpu8_dp_mp.gin"), ("pipelined", "layouts/cpu8_pipeline.gin")]:
    (tmp_path / name).mkdir()
    for path in folder.glob("model.ckpt.*"):
      shutil.copy(path, tmp_path / name / path.name.replace("model.ckpt", "model.ckpt-0"))
    runs[name] = driver_step(tmp_path / name, corpus, layout)
  runs["warm-started"] = driver_step(tmp_path / "warm", corpus, "layouts/cpu8_pipeline.gin",
                                     init_checkpoint=str(folder / "model.ckpt"))
  want_loss, want = runs["unpipelined"]
  for name, (loss, values) in runs.items():
    print(f"{name}: loss {loss:.6f}, max |variables - unpipelined| "
          f"{max(float(np.max(np.abs(values[k] - want[k]))) for k in want):.2e}")
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=name)
    assert sorted(values) == sorted(want)
    for key in want:
      np.testing.assert_allclose(values[key], want[key], rtol=1e-5, atol=1e-5, err_msg=f"{name}: {key}")
  for key in want:   # the step started from the original's weights: 3.2% off (a fresh init: ~100%)
    if "slot" not in key and key != "global_step":
      start = original.get_tensor(key)
      assert np.linalg.norm(want[key] - start) < 0.1 * np.linalg.norm(start), key
