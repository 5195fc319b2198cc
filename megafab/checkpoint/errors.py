"""The checkpoint package's user-facing error."""

from megafab.errors import MegafabError


class CheckpointError(MegafabError):
    """A checkpoint that cannot be saved or loaded here; the message names the key or file, the
    rule and the fix."""
