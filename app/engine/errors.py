"""Exception types raised by the engine binding.

Every native failure (NULL handle, negative return code, failed state restore) is turned into one of these,
with a message that says what was attempted and, when upstream logged a reason, that reason. Callers
catch `EngineError` to handle all of them.
"""

from __future__ import annotations


class EngineError(RuntimeError):
    """Base class: a native engine call failed or the binding was used incorrectly (e.g. after close())."""


class ModelLoadError(EngineError):
    """A model could not be loaded: missing file, not GGUF, truncated, unknown architecture, ..."""


class ContextError(EngineError):
    """A context could not be created with the requested parameters (e.g. the KV cache does not fit)."""


class DecodeError(EngineError):
    """llama_decode / llama_encode / llama_process returned a non-zero code.

    `code` is upstream's return value: 1 = no KV cache slot for the batch, 2 = aborted, -1 = invalid
    batch, < -1 = fatal error. For 2 and < -1, the ubatches already processed stay in the memory; query
    seq_pos_max() to see how far it got.
    """

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class GrammarError(EngineError, ValueError):
    """A GBNF grammar failed to parse; the message carries upstream's parser error."""


class StateError(EngineError):
    """Saving or restoring a sequence state failed (buffer too small, wrong magic, incompatible state)."""
