"""Project error types. Each carries a message a user can act on."""


class LmforgeError(Exception):
    """Base class for errors caused by user input (config, data, model specs)."""


class ConfigError(LmforgeError, ValueError):
    """A config key, value or file is invalid."""


class DataError(LmforgeError, ValueError):
    """A data file or row is malformed, missing or empty."""


class ModelLoadError(LmforgeError):
    """A model spec could not be resolved or loaded."""


class TrainingError(LmforgeError, RuntimeError):
    """Training cannot continue (for example a non-finite loss)."""
