"""Real GPUs: the device interface (Zeus/NVML, or a fake for tests) and the clock guard.

Nothing here imports torch, Zeus or NVML at module import: they are loaded when a real
device is opened, so the base install and the tests work without them.
"""
