"""GPU tests carry the ``gpu`` marker and skip, saying why, on machines without a usable CUDA GPU."""
import functools

import pytest


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason():
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        if n == 0:
            return "no CUDA GPU on this machine"
    except Exception as e:  # no driver, no CuPy
        return f"no usable CUDA GPU here ({type(e).__name__}: {str(e)[:80]})"
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _chained_launches_per_test():
    """speedcore.LLM turns chained launches on for the whole process (speedcore._launch): each test gets the
    setting it started with back, so no test depends on which engine test ran before it."""
    from speedcore import _launch

    prev = _launch._chain_launches[0]
    yield
    if _launch._chain_launches[0] != prev:
        _launch.set_chained_launches(prev)
