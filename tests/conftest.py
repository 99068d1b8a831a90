"""Test set-up: 16 simulated CPU devices, forced before any JAX backend starts."""

import os

N_DEVICES = 16
_flag = f"--xla_force_host_platform_device_count={N_DEVICES}"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def require_devices(n: int) -> list:
  """Returns ``n`` devices or fails (never skips) saying how to get them."""
  devices = jax.devices()
  if len(devices) < n:
    pytest.fail(
        f"this test needs {n} devices but JAX sees {len(devices)}; run pytest "
        f"from the repository root so tests/conftest.py sets XLA_FLAGS="
        f"--xla_force_host_platform_device_count={N_DEVICES} before JAX "
        "starts.")
  return devices[:n]


@pytest.fixture
def x64():
  """Enables float64 for one test only."""
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", False)
