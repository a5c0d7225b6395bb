"""The exceptions of the expert engine; the CLI turns each into one line and exit code 2."""


class MoeSwarmError(Exception):
    """Base of every error a user can cause and fix; its message says what to do."""


class ModelFormatError(MoeSwarmError):
    """A GGUF file is truncated, inconsistent or of an unsupported kind."""


class SliceError(MoeSwarmError):
    """A slice request is out of range, or a slice does not belong to the model at hand."""


class CodecError(MoeSwarmError):
    """Wire bytes do not decode under the codec they claim, or the codec is not allowed."""


class KernelError(MoeSwarmError):
    """The compute kernel on this machine failed its self-test (a row's bits depend on its batch): do not serve."""
