"""Building blocks of the built-in models."""
