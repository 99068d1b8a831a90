"""Test set-up: 16 simulated CPU devices, forced before any JAX backend starts.

Also a JAX compilation cache for this session only: a fresh temporary
directory (removed when pytest exits), set through the environment so that
the command lines the tests start share it. A program compiled once (a second
Experiment of the same config, the same config in another test file or in a
command-line run) is then read back instead of compiled again; compiling
dominates the suite's time. Nothing persists between sessions.
"""

import atexit
import os
import shutil
import tempfile

N_DEVICES = 16
_flag = f"--xla_force_host_platform_device_count={N_DEVICES}"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The process that starts the session makes the directory; its pytest-xdist
# workers inherit the variable and share it.
_CACHE_DIR = os.environ.get("DECENTRAL_JAX_TEST_JIT_CACHE", "")
if not os.path.isdir(_CACHE_DIR):
  _CACHE_DIR = tempfile.mkdtemp(prefix="decentral_jax_test_jit_cache_")
  os.environ["DECENTRAL_JAX_TEST_JIT_CACHE"] = _CACHE_DIR
  atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

# Also when a plugin imported JAX before this file set the variable.
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)

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


@pytest.fixture(scope="module")
def ray_session():
  """One local Ray session (127.0.0.1, 2 CPUs) per test module, stopped
  after it; Ray missing fails loudly (its tests are in the slow tier)."""
  from decentral_jax.tools.learners import cluster  # pylint: disable=import-outside-toplevel
  ray = cluster.require_ray()
  cluster.start(num_cpus=2)
  yield ray
  ray.shutdown()
