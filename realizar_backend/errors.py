"""Typed errors. Every failure a user can cause maps to one of these, never to a bare
IndexError or KeyError from deep inside a parser."""

from __future__ import annotations


class RealizarError(Exception):
    """Base class of every error this package raises on purpose."""

    def __reduce__(self):
        # pickled whole (an engine process hands a request's error to the server): the default
        # would call the class with args alone and lose status, param and the like
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls, args, state):
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


class SettingsError(RealizarError, ValueError):
    """A configuration value is out of range or of the wrong type; names the REALIZAR_ variable."""


class ModelFormatError(RealizarError):
    """A model file is corrupt, truncated or self-contradictory. Always names the file."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class UnsupportedModelError(RealizarError):
    """A well-formed model that this package cannot run (architecture, tensor type, layout)."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class RequestError(RealizarError):
    """A bad request. `status` is the HTTP status the server answers with; `param` names the
    offending field where there is one (OpenAI's error shape)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error"):
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type
        super().__init__(message)


class ContextOverflowError(RequestError):
    """Prompt plus requested tokens do not fit in the model's context window."""

    def __init__(self, message: str, param: str | None = "max_tokens"):
        super().__init__(message, status=400, param=param, code="context_length_exceeded")


class CapacityError(RealizarError):
    """The server is full (KV cache or queue); the client should retry later."""

    def __init__(self, message: str, retry_after_s: int = 1):
        self.retry_after_s = retry_after_s
        super().__init__(message)


class GrammarError(RealizarError):
    """A sampled token that the request's grammar does not allow (constrained decoding): the
    sampling step did not apply the sequence's mask. The sequence fails; the others go on."""


class GrammarLimitError(RequestError):
    """A request's grammar reached a limit of the grammar engine mid-generation (the parser's
    items, the lexer's states): the grammar's fault, a 400, in-band when the stream has begun."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message, status=400, param=param, code="grammar_too_complex")


class BackendError(RealizarError):
    """A backend could not be created or failed its self-check."""


class ModelFetchError(RealizarError):
    """The default model could not be fetched into the model cache (no package index, a bad
    download, no pip). The message says what to do instead."""


class ChatTemplateError(Exception):
    """A render that failed. kind: "syntax" (the template does not parse), "render" (it raised:
    raise_exception, a sandbox refusal, a type error on these messages), "limit" (time, output
    size or memory), "unavailable" (no worker process could be started)."""

    def __init__(self, kind: str, message: str):
        self.kind = kind
        self.message = message
        super().__init__(message)
