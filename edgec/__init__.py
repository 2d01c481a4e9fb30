"""edgec: compile a decoder-only language model into a bundle that runs offline on one named target."""

__version__ = "0.1.0"
