"""Test session set-up: 8 virtual CPU devices before any TensorFlow op runs."""

from tests.harness import configure_virtual_cpus

configure_virtual_cpus()
