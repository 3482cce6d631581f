"""Pure-PyTorch model code: LLaMA and OPT forwards over a paged KV pool."""
