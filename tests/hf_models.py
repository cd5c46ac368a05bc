"""Shared by the tests that build Hugging Face models from configs (offline, optional extra)."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:
    import transformers

    transformers.logging.set_verbosity_error()
except ImportError:  # the hf extra is optional
    transformers = None

needs_hf = pytest.mark.skipif(transformers is None, reason="needs the hf extra (transformers)")
