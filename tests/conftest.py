"""Test session set-up: 8 virtual CPU devices before any TensorFlow op runs; gin bindings per test."""

import gin
import pytest

from tests.differential.summary import pytest_terminal_summary  # noqa: F401  (a hook)
from tests.harness import configure_virtual_cpus
from tests.temp_dir_guard import pytest_configure, pytest_sessionfinish  # noqa: F401  (hooks)

configure_virtual_cpus()


def pytest_collection_modifyitems(items):
  """tf.test.TestCase has a helper method named test_session that pytest would collect as a test."""
  items[:] = [item for item in items if item.name != "test_session"]


@pytest.fixture(autouse=True)
def _fresh_gin_config():
  """No test sees the gin bindings another test parsed (e.g. `mtf.explain` of a gin Transformer)."""
  gin.clear_config()
  yield
  gin.clear_config()
