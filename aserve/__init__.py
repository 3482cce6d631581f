"""aserve: an LLM inference server that keeps mixed workloads from slowing each other down."""
__version__ = "0.1.0"
