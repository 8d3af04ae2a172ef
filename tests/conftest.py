"""Test set-up: eight fake CPU devices, unless XLA_FLAGS already says otherwise."""

import os

# Must happen before JAX starts its backends (it reads XLA_FLAGS then).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

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
    yield seen
    jax.monitoring.unregister_event_duration_listener(listener)
