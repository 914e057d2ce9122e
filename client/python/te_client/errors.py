"""TeError: every failure te_client reports, carrying a gRPC status code.

The server's code and message arrive unchanged (a bad shape names its field,
e.g. "x.shape[2]"); failures of the transport itself are UNAVAILABLE or
DEADLINE_EXCEEDED. One subclass per code a caller can act on, so callers can
write `except te_client.FailedPreconditionError:`; all share `.code` (a
grpc.StatusCode) and `.message`.
"""
import grpc


class TeError(Exception):
    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message, code=None):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message

    def __str__(self):
        return "%s: %s" % (self.code.name, self.message)


class InvalidArgumentError(TeError):
    """Fix the request: a shape, dtype or field is wrong (the message names it)."""
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPreconditionError(TeError):
    """Change state first: e.g. init the layer under autocast before applying FP8."""
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFoundError(TeError):
    """The session, layer, forward or tensor is gone (the message says why)."""
    code = grpc.StatusCode.NOT_FOUND


class UnauthenticatedError(TeError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(TeError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(TeError):
    """Retry later, or free resident tensors / close sessions."""
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(TeError):
    """The server cannot be reached."""
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(TeError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnimplementedError(TeError):
    code = grpc.StatusCode.UNIMPLEMENTED


_BY_CODE = {cls.code: cls for cls in (
    InvalidArgumentError, FailedPreconditionError, NotFoundError, UnauthenticatedError,
    PermissionDeniedError, ResourceExhaustedError, UnavailableError, DeadlineExceededError,
    UnimplementedError)}


def error(code, message):
    """The TeError subclass for `code` (TeError itself for the other codes)."""
    cls = _BY_CODE.get(code)
    return cls(message) if cls is not None else TeError(message, code)


def from_rpc_error(e):
    """A grpc.RpcError as a TeError with the server's code and message."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    return error(code, details or code.name)
