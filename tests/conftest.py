"""Test session set-up: 8 virtual CPU devices before any TensorFlow op runs."""

from tests.harness import configure_virtual_cpus

configure_virtual_cpus()


def pytest_collection_modifyitems(items):
  """tf.test.TestCase has a helper method named test_session that pytest would collect as a test."""
  items[:] = [item for item in items if item.name != "test_session"]
