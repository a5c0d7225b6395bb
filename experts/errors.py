"""The one exception hierarchy of moeswarm (every package raises from these roots).

The split follows h11: a :class:`LocalProtocolError` means this side misused an API or
protocol (a bug here), a :class:`RemoteProtocolError` means a peer or a file broke the
format (their fault; log it with who sent it, answer with an error frame). A
:class:`UsageError` is a mistake the person running the command can fix, and its message
says how: it is the only error the CLI turns into one ``error:`` line (exit 2); anything
else keeps its traceback, so an internal bug never reads as a user mistake.

It lives in :mod:`experts`, the bottom package, so that :mod:`p2p`, :mod:`relay` and
:mod:`node` can all derive from it without an upward import.
"""


class MoeSwarmError(Exception):
    """Root of every error moeswarm raises on purpose."""


class UsageError(MoeSwarmError):
    """A mistake the user can fix (bad option, wrong file, missing permission); the message says what to do."""


class LocalProtocolError(MoeSwarmError):
    """This side broke a protocol or misused an API: a bug here, not the peer's fault."""


class RemoteProtocolError(MoeSwarmError):
    """A peer (or a file from elsewhere) broke the format or the protocol."""


class ModelFormatError(UsageError):
    """A GGUF file is truncated, inconsistent or of an unsupported kind."""


class SliceError(UsageError):
    """A slice request is out of range, or a slice does not belong to the model at hand."""


class CodecError(UsageError):
    """Wire bytes do not decode under the codec they claim, or the codec is not allowed."""


class KernelError(UsageError):
    """The compute kernel on this machine failed its self-test (a row's bits depend on its batch): do not serve.

    A usage error because the operator can act on it: choose another kernel (``--kernel reference``).
    """


class TrustError(UsageError):
    """A CA file given to verify TLS peers (``--relay-ca``) cannot be read or holds no PEM certificate."""
