"""Errors the engine reports to its callers (kept free of heavy imports for the server)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after a failure; no request can be served any more."""


class RequestCancelledError(RuntimeError):
    """The server cancelled a request it had accepted (a shutdown outlasted its timeout)."""


class ReplicaLostError(RuntimeError):
    """A data-parallel replica on another node was lost (its process ended or stopped
    answering): the requests it held fail with this while the other replicas serve on. Among
    a step's outputs it stands for its request's last output."""

    finished = True

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


class EngineSleepingError(RuntimeError):
    """A request reached an engine put to sleep (sleep mode): it is refused, not queued, until
    the engine wakes up."""
