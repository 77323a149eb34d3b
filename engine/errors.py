"""Errors the engine raises for user mistakes: each names the file/field and what is accepted."""


class BatchgenError(Exception):
    """Base class for errors that are shown to the user as one clear message (no traceback)."""


class ModelLoadError(BatchgenError):
    """A model path, file, architecture or quantization type that cannot be loaded."""


class ConfigError(BatchgenError):
    """An impossible engine setting."""
