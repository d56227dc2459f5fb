"""Exception types. Each names what is at fault and what to do about it."""

from __future__ import annotations


class BoostError(Exception):
    """Base class of every error boost-compiler raises on purpose."""


class OptionError(BoostError, ValueError):
    """An option passed through ``torch.compile(..., options=...)`` is wrong."""


class UnknownOptionError(OptionError, KeyError):
    """An option name that no pass or setting of the boost backend knows."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class OptionTypeError(OptionError, TypeError):
    """A known option given a value of the wrong type or outside its choices."""


class CaptureError(BoostError, RuntimeError):
    """The model could not be captured as an FX graph with the example inputs."""


class ShardingError(BoostError, ValueError):
    """A model dimension cannot be split over the tensor-parallel degree."""


class MeshError(BoostError, ValueError):
    """The device mesh or process group given to ``parallelize`` is unusable."""


class MutationError(BoostError, RuntimeError):
    """An in-place write that cannot be rewritten exactly (names the op and the source line)."""


class AlreadyParallelizedError(BoostError, RuntimeError):
    """``parallelize`` was called on a model that is already parallelized."""


class UncompiledFrameError(BoostError, RuntimeError):
    """A part of a parallelized model ran as plain Python, outside the compiled graphs."""


class CheckpointError(BoostError):
    """No usable checkpoint, or one that does not fit the model (names what)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is missing, truncated or differs from its manifest (names the file)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint's metadata names something that could run code when loaded."""
