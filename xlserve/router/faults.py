"""What goes wrong on the far side of the router, as exceptions the dispatcher acts on."""


class WorkerFailed(Exception):
    """A worker failed (unreachable, 5xx, broken stream, no progress in time): marked down."""


class NoWorker(WorkerFailed):
    """No healthy worker of a stage is left to try."""
