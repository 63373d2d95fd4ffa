"""purinec: a Purine-style bi-graph compiler for deep networks."""

__version__ = "0.1.0"
