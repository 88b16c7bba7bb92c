"""export_infer / export_score SavedModels served by a process without mesh_tensorflow.

A tiny language model (the 6 steps shared_runs trains) and a tiny encoder-decoder (bfloat16 master
variables, one step) trained on two devices; their exports are loaded in one subprocess where
`import mesh_tensorflow` fails, in TF2 (tf.saved_model.load) and in a default TF1 session (no soft
placement), with fewer strings than the batch size, and must reproduce the `infer` mode's decodes
and `score_from_strings`' scores of the same checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import gin
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from mesh_tensorflow.transformer import utils
from mesh_tensorflow.transformer import vocabulary as vocabulary_lib
from mesh_tensorflow.transformer._train import export, loop
from tests.transformer import shared_runs, tiny_run
from tests.transformer.tiny_run import run

# One worker runs the modules reading shared_runs.py's training, so it is done once.
pytestmark = [pytest.mark.xdist_group("tiny_transformer_run"), pytest.mark.slow]

BATCH_SIZE = 8  # tiny_run.TINY's utils.run.batch_size
LM_PROMPTS = ["line 3: the", "line", "x"]
LM_TARGETS = ["line 1: the quick", "zzzz qqqq xxxx", "line"]
ENC_DEC_INPUTS = ["12345", "907", "4"]
ENC_DEC_TARGETS = ["54321", "709", "9"]
ENC_DEC = ["utils.run.model_type = 'bitransformer'",
           "utils.run.train_dataset_fn = @data.transduction_dataset",
           "data.transduction_dataset.num_train_examples = 64",
           "utils.get_variable_dtype.master_dtype = 'bfloat16'"]  # checkpointed in bfloat16

# Runs with mesh_tensorflow unimportable; prints the results of every model's requests as JSON.
CLIENT = r"""
import json, sys
sys.modules["mesh_tensorflow"] = None  # `import mesh_tensorflow` raises ImportError from here on
import tensorflow as tf

loaded = {}

def tf2(path, signature="serving_default", **kwargs):
  if path not in loaded:
    loaded[path] = tf.saved_model.load(path)
  return loaded[path].signatures[signature](**kwargs)

def tf1(path, output, feeds, device_count=None):
  config = tf.compat.v1.ConfigProto(device_count=device_count or {})
  with tf.Graph().as_default(), tf.compat.v1.Session(config=config) as session:
    meta_graph = tf.compat.v1.saved_model.loader.load(session, ["serve"], path)
    signature = meta_graph.signature_def["serving_default"]
    return session.run(signature.outputs[output].name,
                       {signature.inputs[k].name: v for k, v in feeds.items()}).tolist()

hexes = lambda strings: [s.hex() for s in strings]

def requests(spec):
  texts = lambda key: tf.constant(spec[key])
  result = {}
  infer = spec["infer"]
  result["tf2_greedy"] = hexes(tf2(infer, inputs=texts("inputs"))["outputs"].numpy())
  result["tf1_greedy"] = hexes(tf1(infer, "outputs", {"inputs": spec["inputs"]}))
  if spec["infer_mesh"]:
    result["tf1_mesh_devices"] = hexes(tf1(spec["infer_mesh"], "outputs", {"inputs": spec["inputs"]},
                                           device_count={"CPU": 2}))
  sample = lambda temperature, seed: hexes(tf2(
      infer, "sample", inputs=texts("inputs"), temperature=tf.constant(temperature),
      seed=tf.constant(seed, tf.int64))["outputs"].numpy())
  result["sample_t0"] = sample(0.0, 1)
  result["sample_seed1"], result["sample_seed1_again"], result["sample_seed2"] = (
      sample(1.0, 1), sample(1.0, 1), sample(1.0, 2))
  if spec["sampled"]:
    result["default_sampled_calls"] = [
        hexes(tf2(spec["sampled"], inputs=texts("inputs"))["outputs"].numpy()) for _ in range(2)]
  score_feeds = {k: spec[k] for k in spec["score_features"]}
  result["tf2_scores"] = tf2(spec["score"], **{k: tf.constant(v) for k, v in score_feeds.items()}
                             )["scores"].numpy().tolist()
  result["tf1_scores"] = tf1(spec["score"], "scores", score_feeds)
  try:
    tf2(infer, inputs=tf.constant(["a"] * (spec["batch_size"] + 1)))
  except tf.errors.InvalidArgumentError as e:
    result["too_many"] = e.message
  return result

print("RESULT " + json.dumps({name: requests(spec) for name, spec in json.loads(sys.argv[1]).items()}))
"""


@dataclasses.dataclass
class Served:
  """In-process references of one checkpoint, its exports, and what the mtf-free client got from them."""
  decodes: list
  scores: list
  infer_dir: str
  score_dir: str
  infer_mesh_dir: str
  second_export_error: str
  spec: dict  # what the client is asked to do
  client: dict = None


def _decoded(hexes):
  return [bytes.fromhex(h).decode("utf-8", errors="ignore") for h in hexes]


def _serve(directory, model_dir, step: int, inputs, targets, score_with_inputs,
           sampled_binding=None) -> Served:
  """Runs infer and score_from_strings on model_dir's checkpoint of `step`, and exports it; with
  `sampled_binding` (a temperature's gin name) also exports on the mesh's devices and sampling."""
  (directory / "inputs.txt").write_text("".join(t + "\n" for t in inputs))
  with gin.unlock_config():
    gin.bind_parameter("utils.decode_from_file.input_filename", str(directory / "inputs.txt"))
    gin.bind_parameter("utils.decode_from_file.output_filename", str(directory / "decodes"))
    gin.bind_parameter("utils.score_from_strings.targets", targets)
    if score_with_inputs:
      gin.bind_parameter("utils.score_from_strings.inputs", inputs)
  decodes = run(model_dir, "infer", eval_checkpoint_step=step)[step]
  scores = run(model_dir, "score_from_strings", eval_checkpoint_step=step)[step]
  spec = {"inputs": inputs, "targets": targets, "batch_size": BATCH_SIZE,
          "score_features": ["inputs", "targets"] if score_with_inputs else ["targets"],
          "infer": run(model_dir, "export_infer", export_path=str(directory / "infer")),
          "score": run(model_dir, "export_score", export_path=str(directory / "score"))}
  with pytest.raises(ValueError) as again:
    run(model_dir, "export_infer", export_path=str(directory / "infer"))
  spec["infer_mesh"] = spec["sampled"] = None
  if sampled_binding:
    with gin.unlock_config():
      gin.bind_parameter("utils.export_serving.devices", "mesh")
    spec["infer_mesh"] = run(model_dir, "export_infer", export_path=str(directory / "infer_mesh"))
    with gin.unlock_config():
      gin.bind_parameter(sampled_binding, 1.0)
      gin.bind_parameter("utils.export_serving.devices", "one")
    spec["sampled"] = run(model_dir, "export_infer", export_path=str(directory / "sampled"))
  return Served(decodes, scores, spec["infer"], spec["score"], spec["infer_mesh"], str(again.value), spec)


def _run_client(specs: dict, cwd: str) -> dict:
  """name -> the client's results for specs[name], all from one process without mesh_tensorflow."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  done = subprocess.run([sys.executable, "-c", CLIENT, json.dumps(specs)], capture_output=True, text=True,
                        cwd=cwd, env=env, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
  return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
  """Both models trained and exported in this process, then served by one mtf-free client process."""
  trained_lm = shared_runs.tiny_lm(tmp_path_factory)  # 6 steps
  lm_directory, enc_dec_directory = tmp_path_factory.mktemp("lm"), tmp_path_factory.mktemp("enc_dec")
  try:
    tiny_run.configure_gin(trained_lm.corpus, tiny_run.TWO_DEVICES)
    models = {"lm": _serve(lm_directory, shared_runs.copy_model_dir(trained_lm, lm_directory / "model"), 6,
                           LM_PROMPTS, LM_TARGETS, False, "Unitransformer.sample_autoregressive.temperature")}
    tiny_run.configure_gin(tiny_run.write_corpus(str(enc_dec_directory)),
                           tiny_run.TWO_DEVICES + ENC_DEC + ["utils.run.train_steps = 1"])
    run(enc_dec_directory / "model", "train")
    models["enc_dec"] = _serve(enc_dec_directory, enc_dec_directory / "model", 1, ENC_DEC_INPUTS,
                               ENC_DEC_TARGETS, True)
  finally:
    gin.clear_config()
    utils.FLAGS.unparse_flags()
  clients = _run_client({name: m.spec for name, m in models.items()}, os.path.dirname(models["lm"].infer_dir))
  return {name: dataclasses.replace(m, client=clients[name]) for name, m in models.items()}


@pytest.fixture
def lm(models) -> Served:
  return models["lm"]


@pytest.fixture
def enc_dec(models) -> Served:
  return models["enc_dec"]


@pytest.fixture(params=["lm", "enc_dec"])
def served(request, models) -> Served:
  return models[request.param]


def test_tf2_and_a_default_tf1_session_reproduce_infer_for_fewer_strings_than_the_batch(served):
  assert len(served.decodes) == 3 < BATCH_SIZE
  assert _decoded(served.client["tf2_greedy"]) == served.decodes
  assert _decoded(served.client["tf1_greedy"]) == served.decodes


def test_the_score_signature_reproduces_score_from_strings(served):
  np.testing.assert_allclose(served.client["tf2_scores"], served.scores, rtol=1e-5)
  np.testing.assert_allclose(served.client["tf1_scores"], served.scores, rtol=1e-5)
  assert all(s < 0 for s in served.scores)


def test_the_language_models_score_signature_takes_targets_only(lm, enc_dec):
  def signature_inputs(served):
    with tf.Graph().as_default(), tf.Session() as session:
      meta_graph = tf.saved_model.loader.load(session, [tf.saved_model.SERVING], served.score_dir)
      return sorted(meta_graph.signature_def["serving_default"].inputs)
  assert signature_inputs(lm) == ["targets"]
  assert signature_inputs(enc_dec) == ["inputs", "targets"]


def test_temperature_zero_samples_greedily_and_positive_temperatures_follow_the_seed(served):
  client = served.client
  assert _decoded(client["sample_t0"]) == served.decodes
  assert client["sample_seed1"] == client["sample_seed1_again"]
  assert client["sample_seed1"] != client["sample_seed2"]
  assert client["sample_seed1"] != client["tf2_greedy"]


def test_an_export_sampling_by_default_draws_afresh_at_each_call(lm):
  first, second = lm.client["default_sampled_calls"]
  assert len(first) == len(second) == 3 and first != second


def test_more_strings_than_the_batch_size_fail_naming_it(served):
  assert f"at most {BATCH_SIZE} strings per request" in served.client["too_many"]


def _node_devices(path) -> set:
  with tf.Graph().as_default(), tf.Session() as session:
    graph_def = tf.saved_model.loader.load(session, [tf.saved_model.SERVING], path).graph_def
  devices = {node.device for node in graph_def.node}
  for function in graph_def.library.function:
    devices.update(node.device for node in function.node_def)
  return devices


def test_the_default_export_names_no_device_and_the_mesh_export_keeps_the_meshs(lm):
  assert _node_devices(lm.infer_dir) == {""}
  assert any(d.upper().endswith("CPU:1") for d in _node_devices(lm.infer_mesh_dir))
  assert _decoded(lm.client["tf1_mesh_devices"]) == lm.decodes


def test_exporting_a_step_again_to_the_same_place_is_refused_naming_the_directory(lm):
  assert lm.second_export_error.startswith(f"{lm.infer_dir} already exists")
  assert "utils.run.export_path" in lm.second_export_error


def test_an_unknown_devices_value_is_refused():
  with pytest.raises(ValueError, match=r"utils.export_serving.devices = 'gpu'; expected one of"):
    export.export_model(None, None, "", "", score=False, devices="gpu")


class _PythonVocabulary(vocabulary_lib.Vocabulary):
  """Encodes in Python only (encode_tf / decode_tf are py_functions)."""
  vocab_size = 10

  def encode(self, s):
    return [3] * len(s)

  def decode(self, ids):
    return "x" * len(ids)


def test_a_vocabulary_that_needs_python_in_the_graph_is_refused():
  runner = loop.ModelRunner(model=None, mesh_shape="batch:2", layout_rules="batch:batch",
                            batch_size=BATCH_SIZE, sequence_length={"inputs": 16, "targets": 16},
                            variable_dtype=None)
  with pytest.raises(ValueError, match=r"targets vocabulary _PythonVocabulary encodes/decodes with Python"):
    export.export_model(runner, _PythonVocabulary(), "", "", score=False)
