"""Error types shared across kvtransport.

`UserError` marks a mistake the user can fix (bad argument, missing or corrupt file,
not root). The CLI prints its message on one line and exits with status 2, never a
traceback. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem caused by the user's input; the message is shown as-is."""
