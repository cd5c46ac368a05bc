"""interlace: hybrid-parallel training of dense and Mixture-of-Experts transformers."""

__version__ = "0.1.0"
