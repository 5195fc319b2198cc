"""The one error class of the data layer: a user-facing problem with a file, a flag or an input."""

from megafab.errors import MegafabError


class DataError(MegafabError):
    """Bad data or a bad data argument; the message names the file or value, the problem and the fix."""
