"""rigserve: a llama.cpp-compatible LLM server for GPU rigs (import package `app`)."""

__version__ = "0.1.0"
