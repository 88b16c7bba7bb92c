"""Fixtures of the Transformer driver tests."""

import gin
import pytest

from mesh_tensorflow.transformer import utils
from tests.transformer import tiny_run


@pytest.fixture
def corpus(tmp_path):
  """The tiny corpus's glob; gin and the flags are cleared after the test."""
  yield tiny_run.write_corpus(str(tmp_path))
  gin.clear_config()
  utils.FLAGS.unparse_flags()
