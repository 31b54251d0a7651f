"""Test helpers shipped with kvdepot so integrators can test against a real daemon."""

from kvdepot.testing.daemon import DaemonProcess, free_port
from kvdepot.testing.fake_engine import FakeEngine, FakeRequest

__all__ = ["DaemonProcess", "FakeEngine", "FakeRequest", "free_port"]
