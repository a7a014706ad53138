"""User-facing errors: each is shown as one line, never as a traceback."""


def first_line(exc: BaseException, limit: int = 500) -> str:
    """The first line of `exc`'s text (its type's name where it has none), cut to `limit` characters."""
    lines = str(exc).strip().splitlines()
    return lines[0][:limit] if lines else type(exc).__name__


class PolyspecError(Exception):
    """A mistake the user can fix (bad config, bad request, unknown model path)."""


class ConfigError(PolyspecError):
    pass


class ModelLoadError(PolyspecError):
    pass


class RequestError(PolyspecError):
    pass
