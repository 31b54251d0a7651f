import os

from hypothesis import settings

# Default runs are deterministic; the fuzz stage of .ci/run explores with random seeds.
settings.register_profile("default", derandomize=True, deadline=None)
settings.register_profile("fuzz", derandomize=False, deadline=None, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
