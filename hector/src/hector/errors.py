"""Exception types. Each names a category, never a backend; messages name the problem and the fix."""


class HectorError(Exception):
    """Base class of hector's own errors."""


class DSLTypeError(HectorError, TypeError):
    """A layer program combines values whose domains (node/edge/...) or feature shapes do not fit."""


class IRVerificationError(HectorError, ValueError):
    """A program breaks an IR invariant (use before definition, wrong arity, stale type, ...)."""


class GraphInputError(HectorError, ValueError):
    """A graph given to a layer is malformed (shapes, dtypes, ids out of range, empty)."""
