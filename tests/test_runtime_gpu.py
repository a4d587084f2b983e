"""The runtime on a GPU: compile time, disk-cache load time, device properties, launch checks."""
import pytest


@pytest.mark.gpu
@pytest.mark.big
def test_first_compile_and_disk_cache_load_times(tmp_path):
    from speedcore.bench import load_suite, suites

    runtime = load_suite(suites()["runtime"])
    first, second = runtime.compile_and_load_times(tmp_path)
    print(f"\nfirst use (NVRTC compile + load): {first * 1e3:.0f} ms; "
          f"new process from disk cache: {second * 1e3:.1f} ms")
    assert first < 3.0
    assert second < 0.05


@pytest.mark.gpu
def test_device_info_and_launch_checks():
    from speedcore._launch import LaunchConfig, device_info, get_kernel
    from speedcore import norm

    d = device_info(0)
    assert d.sms > 0 and d.smem_per_block_optin >= 48 * 1024 and d.cc >= (8, 0)
    lk = get_kernel(norm._kernel("float16", 1, False), 0)
    with pytest.raises(ValueError, match="shared memory per block"):
        lk.check(LaunchConfig((1,), (128,), d.smem_per_block_optin + 1))
    with pytest.raises(ValueError, match="threads per block"):
        lk.check(LaunchConfig((1,), (2048,)))
    with pytest.raises(ValueError, match="grid"):
        lk.check(LaunchConfig((0,), (128,)))
    with pytest.raises(ValueError, match="clusters of 3"):
        lk.check(LaunchConfig((8,), (128,), cluster=3))  # the cluster must divide the grid
    with pytest.raises(ValueError, match="clusters of 16"):
        lk.check(LaunchConfig((16,), (128,), cluster=16))
