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


class ExpertAlignmentError(ShardingError):
    """A rank's slice of an expert weight would break ``torch._grouped_mm``'s 16-byte
    stride alignment (it fails on CUDA)."""


class MeshError(BoostError, ValueError):
    """The device mesh or process group given to ``parallelize`` is unusable."""


class RankMismatchError(MeshError):
    """The ranks of a tensor-parallel group were given different things where they must
    agree: the model's structure, the plan, the options, or a call's shapes (names each
    rank's value); every rank raises it, none is left waiting in a collective."""


class PeerRankError(BoostError, RuntimeError):
    """Another rank of the tensor-parallel group failed where this one did not (names the
    rank and its error): this rank stops too instead of waiting for it in a collective."""


class MutationError(BoostError, RuntimeError):
    """An in-place write that cannot be rewritten exactly (names the op and the source line)."""


class AlreadyParallelizedError(BoostError, RuntimeError):
    """``parallelize`` was called on a model that is already parallelized."""


class UncompiledFrameError(BoostError, RuntimeError):
    """A part of a parallelized model ran as plain Python, outside the compiled graphs."""


class ClosureError(BoostError, TypeError):
    """A function stored on a module reaches the model's modules in a way the shadow cannot rebind."""


class PlanMismatchError(BoostError, ValueError):
    """A plan given to ``parallelize(..., plan=)`` does not fit the model or the mesh.

    The message names every parameter at fault (missing, unknown, another shape, a
    split its size cannot take) or the degree; nothing was modified.
    """


class PlanFileError(BoostError, ValueError):
    """A saved plan file that is not one: unreadable JSON, another format or version."""


class HookAfterParallelizeError(BoostError, RuntimeError):
    """A hook registered on an inner module of a parallelized model, which never runs.

    The model's forward runs the shadow (see :mod:`boost_compiler.parallel.shadow`), a copy of
    its module tree taken by ``parallelize``: register such hooks before ``parallelize``,
    or on the parallelized model itself.
    """


class StateDictError(BoostError, ValueError):
    """A state dict does not fit the parallelized model (names the key at fault)."""


class ConversionError(BoostError, ValueError):
    """``to_low_rank`` cannot convert the model as asked; the message names the module."""


class RankError(ConversionError):
    """The requested rank is not below ``min(d_in, d_out)`` of a layer (no bottleneck)."""


class PatternError(ConversionError):
    """An ``include`` pattern matches no module of the model (likely a typo)."""


class UnsupportedModuleError(ConversionError, TypeError):
    """A module selected by name is of a kind ``to_low_rank`` cannot factor."""


class UnknownConfigError(BoostError, KeyError):
    """A model size the cost model has no built-in dimensions for."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class OutputPathError(BoostError, ValueError):
    """A report's output path that cannot be written as asked (``boost explain --out``, the
    ``out_dir`` of :func:`~boost_compiler.explain.explain`): a file, or a path under one,
    where a folder goes (names the path)."""


class TrainConfigError(BoostError, ValueError):
    """A training configuration value is missing, unknown or inconsistent (names it)."""


class BenchError(BoostError):
    """``boost bench`` cannot run: a bad argument (size, system, GEMM scale)."""


class CheckpointError(BoostError):
    """No usable checkpoint, or one that does not fit the model (names what)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is missing, truncated or differs from its manifest (names the file)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint's metadata names something that could run code when loaded."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint of the same model keys whose tensor shapes differ from the model's (names
    the key, both shapes and the flag that likely changed: --rank, --rank-ratio, model size)."""


class PipelineError(BoostError, ValueError):
    """A pipeline-parallel layout that cannot be built (layer split, mesh, micro-batches)."""


class ParallelModelCopyError(BoostError, TypeError):
    """``torch.save``/``pickle``/``copy.deepcopy`` of a parallelized model (it holds per-rank
    shards and a compiled shadow); save ``gather_state_dict(model)`` or a DCP checkpoint."""


class DataError(BoostError, ValueError):
    """Training data that cannot be read or tokenized as asked (names the file, the field or
    the tokenizer, and what to do)."""


class VocabSizeError(DataError):
    """The model's vocabulary cannot hold the tokenizer's ids (names both sizes)."""


class HFFolderError(BoostError, ValueError):
    """A Hugging Face model folder that cannot be read or written as asked: no config.json,
    a ``boost_low_rank`` layout that does not fit the model, weights that do not match it
    (names the file, the key or the module)."""


class LayoutError(HFFolderError):
    """A folder in another project's low-rank layout (CoLA, CoLA-M, LORO, SLTrain, the BOOST
    reference's Nanotron) that cannot be read or written as asked: a key missing or of
    another shape, a projection the layout cannot express (names the key, the module and
    the layout)."""


class RemoteCodeError(HFFolderError):
    """A Hugging Face folder whose ``config.json`` needs code from the folder or the Hub
    (``auto_map``, or a ``model_type`` transformers does not define): boost never runs it."""


class RankFailureError(BoostError, RuntimeError):
    """A collective failed because another rank exited, hung past ``--comm-timeout`` or closed
    its connection (names the lost rank when it is on this host); resume from a checkpoint."""


class RunFolderError(BoostError, ValueError):
    """The run's folder or files cannot be used as asked: ``--checkpoint-dir`` / ``--metrics``
    not writable, a folder where a file goes (or the reverse), or a folder that holds another
    run without ``--resume`` / ``--overwrite`` (names the path and the flag)."""


class RunLockedError(RunFolderError):
    """Another trainer holds the ``--checkpoint-dir`` folder's lock (names its host and pid)."""


class NoUsableCheckpointError(CheckpointError):
    """``--resume`` found step folders but none intact (lists each and why); nothing was
    changed: ``--resume-or-start`` sets them aside and starts over."""


class DivergenceError(BoostError, RuntimeError):
    """Training diverged: a non-finite loss, gradient norm or parameter at a step (names the
    step and what was non-finite); no checkpoint of it was saved."""


class LauncherLostError(BoostError, RuntimeError):
    """The launcher (torchrun) that started this rank is gone: the rank stops rather than
    keep writing into the run folder unattended."""
