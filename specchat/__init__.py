"""specchat: speculative decoding you can watch."""

__version__ = "0.1.0"
