"""User-facing errors: each is shown as one line, never as a traceback."""


class PolyspecError(Exception):
    """A mistake the user can fix (bad config, bad request, unknown model path)."""


class ConfigError(PolyspecError):
    pass


class ModelLoadError(PolyspecError):
    pass


class RequestError(PolyspecError):
    pass
