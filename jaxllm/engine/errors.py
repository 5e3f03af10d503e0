"""Errors the engine reports to its callers (kept free of heavy imports for the server)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after a failure; no request can be served any more."""


class RequestCancelledError(RuntimeError):
    """The server cancelled a request it had accepted (a shutdown outlasted its timeout)."""
