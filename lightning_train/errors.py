"""The one exception type for bad user input (config, CLI arguments, data, checkpoints)."""


class UserInputError(ValueError):
    """Bad input from the user. The message names the offending value and the fix; the CLI prints it
    as a single ``error: ...`` line and exits with code 2 instead of showing a traceback."""
