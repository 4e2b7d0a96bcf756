import os

# CPU tests run on 8 fake host devices; this must happen before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
