"""Test set-up: eight fake CPU devices, unless XLA_FLAGS already says otherwise."""

import atexit
import os
import shutil
import tempfile

# Must happen before JAX starts its backends (it reads XLA_FLAGS then).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

# The tests build many identical programs (the same small models over the same
# shapes, in Trainers of their own): each compiles once a session, into a cache
# the processes the tests start share. Tests that count compilations turn it
# off (the ``compiles`` fixture).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # else a parent's (a pytest-xdist controller's)
    _XLA_CACHE = tempfile.mkdtemp(prefix="flaxhooks-tests-xla-")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(params=[1, 8], ids=["1dev", "8dev"])
def devices(request):
    """The first 1 or 8 local devices (skips 8 when fewer exist)."""
    available = jax.local_devices()
    if len(available) < request.param:
        pytest.skip(f"needs {request.param} devices, have {len(available)}")
    return available[: request.param]


@pytest.fixture
def compiles():
    """The XLA compilations (their function names) made while the test runs."""
    seen = []

    def listener(name, duration, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            seen.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # a program the cache holds would not count
    yield seen
    jax.config.update("jax_enable_compilation_cache", cached)
    jax.monitoring.unregister_event_duration_listener(listener)
