"""The engine's errors that a media process meets: raised in the engine process, they reach a media process over
the engine socket pickled by class, and its signaling names them. They live here, apart from the model code, so
that neither unpickling nor naming one imports transformers and the engine (6-7 s of one core, which a media
process's first call spent with the event loop stopped for every call it carried)."""


class EngineFullError(RuntimeError):
    """Every session slot is taken."""


class TurnTooLongError(ValueError):
    """The caller's turn does not fit in the context budget, even with every earlier turn dropped."""
