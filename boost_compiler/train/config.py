"""Training configuration: dataclass defaults, then a TOML file, then command-line flags.

Why three layers: a run is usually described once in a TOML file kept with the
experiment, then varied from the command line (``--tp 4``) without editing the
file. Flags therefore win over the file, and the file over the defaults. The
argparse parser uses ``argparse.SUPPRESS`` as every default, so a flag the user
did not give is absent from the namespace and cannot override the file by accident.

A TOML file holds the same names as the flags (``checkpoint_dir`` or
``checkpoint-dir``) at top level, plus an optional ``[model]`` table of overrides
for the preset (``d_model = 128``), e.g.::

    tp = 2
    steps = 300
    lr = 3e-3
    [model]
    preset = "tiny"   # or, without a [model] table: model = "tiny" at top level
    n_layers = 4
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..convert import METHODS
from ..errors import TrainConfigError
from ..layouts import LAYOUTS
from ..models.cola_llama import CONFIGS
from .flags import add_dataclass_flags, flag
from .schedules import SCHEDULES

NONFINITE_ACTIONS = ("stop", "skip")
MIXED_PRECISIONS = ("none", "bf16")
TXT_UNITS = ("file", "paragraph", "line")


def _layer_counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--pp-layers takes comma-separated layer counts, e.g. 3,5; got {text!r}"
        ) from None


@dataclass
class TrainConfig:
    """Everything that defines a training run. ``batch`` is the GLOBAL batch (all dp ranks).

    Each field with help text is also a ``boost train`` flag (train/flags.py): its
    name, type, choices and default are read from here and nowhere else."""

    # which family trains is train/families.py's choice
    model: str = flag(
        "tiny",
        f"CoLA-LLaMA preset: {', '.join(CONFIGS)}; or pkg.module:function "
        "/ file.py:function building your own model (train/spec_module.py)",
    )
    model_overrides: dict[str, Any] = field(default_factory=dict)  # TOML [model] table
    # Hugging Face models instead of the preset (train/hf_model.py).
    hf_config: str | None = flag(None, "train a Hugging Face model from DIR/config.json "
        "(transformers' own class), made low-rank by to_low_rank, instead of --model",
        unset="--model", metavar="DIR")  # fmt: skip
    init_from: str | None = flag(None, "start from a dense Hugging Face checkpoint folder "
        "(config.json + safetensors), SVD-factored; a boost export --format hf folder, or "
        "another project's low-rank checkpoint (--layout), as it is",
        unset="random init", metavar="DIR")  # fmt: skip
    layout: str | None = flag(None, "--init-from's layout: CoLA, CoLA-M, LORO, SLTrain or the "
        "BOOST reference's Nanotron checkpoint, imported as factor pairs; hf: a Hugging Face "
        "folder", unset="detected from the folder", choices=("hf", *LAYOUTS))  # fmt: skip
    low_rank_method: str | None = flag(None, "to_low_rank method", choices=METHODS,
        unset="cola for --hf-config, svd for --init-from")  # fmt: skip
    # r = floor(ratio * min(d_in, d_out)) to a multiple of rank_multiple
    rank_ratio: float = flag(0.25, "rank = ratio x min(d_in, d_out) of each projection")
    rank: int | None = flag(None, "one rank for every projection", unset="--rank-ratio")
    # Not the tp degree: the layout must be the same at every (dp, tp) for checkpoints to move.
    rank_multiple: int = flag(8, "ranks rounded down to a multiple of N, for tp degrees "
                              "dividing it")  # fmt: skip
    tp: int = flag(1, "tensor-parallel degree (BTP)")
    dp: int | None = flag(None, "data-parallel degree", unset="world / tp / pp")
    pp: int = flag(1, "pipeline stages (--schedule), each stage compiled unless --no-compile; "
                   "checkpoints load at any (pp, dp, tp)")  # fmt: skip
    microbatches: int | None = flag(None, "micro-batches per dp rank and step, with --pp",
        unset="the smallest divisor of the per-rank batch >= 2 x pp, else >= pp")  # fmt: skip
    pp_layers: tuple[int, ...] | None = flag(None, "decoder layers of each pipeline stage, "
        "e.g. 3,5", unset="an even split, extra layers to the middle stages",
        type=_layer_counts, metavar="N,N,...")  # fmt: skip
    schedule: str = flag("1f1b", "pipeline schedule, torch.distributed.pipelining's; the last "
        "two run --virtual-stages stages per rank", choices=SCHEDULES)  # fmt: skip
    virtual_stages: int | None = flag(None, "stages per pp rank for interleaved-1f1b / "
        "zero-bubble", unset="2 for the interleaved ones", metavar="V")  # fmt: skip
    steps: int = flag(100, "optimizer steps in total")
    stop_at: int | None = flag(None, "leave after this many steps, keeping the --steps "
        "schedule (a time-limited job; rerun with --resume)", unset="--steps")  # fmt: skip
    batch: int = flag(8, "GLOBAL batch in sequences, summed over the dp ranks")
    seq: int = flag(64, "sequence length in tokens")
    lr: float = flag(3e-3, "peak learning rate")
    min_lr_ratio: float = flag(0.1, "final lr / peak lr: cosine decays to lr x ratio")
    warmup: int = flag(10, "linear warm-up steps")
    weight_decay: float = flag(0.1, "AdamW weight decay")
    beta1: float = 0.9
    beta2: float = 0.95
    clip: float = flag(1.0, "max global grad norm, 0: off (the norm is still logged)")
    seed: int = flag(0, "model init and data order")
    data: list[str] | None = flag(None, ".txt, .jsonl, .parquet files or folders, streamed "
        "in order", unset="the embedded corpus", metavar="PATH")  # fmt: skip
    tokenizer: str | None = flag(None, "tokenizer.json, or a local transformers tokenizer "
        "folder; the model's vocab is sized from it", unset="UTF-8 bytes",
        metavar="PATH")  # fmt: skip
    text_field: str = flag("text", "jsonl / parquet field of the text")
    txt_unit: str = flag("file", "one document of a .txt file", choices=TXT_UNITS)
    eos_token: str | None = flag(None, "token put between documents, e.g. </s>",
                                 unset="the tokenizer's EOS")  # fmt: skip
    eval_fraction: float = flag(0.0, "hold out this fraction of the --data documents for "
                                "validation")  # fmt: skip
    eval_data: list[str] | None = flag(None, "validate on these files instead",
                                       unset="no held-out files", metavar="PATH")  # fmt: skip
    eval_every: int = flag(0, "validation loss and perplexity every K steps (0: last step "
                           "only)")  # fmt: skip
    eval_batches: int = flag(4, "global batches validated")
    checkpoint_dir: str | None = flag(None, "DCP checkpoints go to DIR/step_N",
                                      unset="no checkpoints")  # fmt: skip
    save_every: int = flag(0, "checkpoint every K steps (0: at the end only)")
    keep: int = flag(0, "keep the newest N checkpoints (0: all)")
    allow_schedule_change: bool = flag(False, "--resume with other --steps/--lr/--warmup/"
                                       "--min-lr-ratio than saved")  # fmt: skip
    resume: bool = flag(False, "continue from DIR's newest intact checkpoint; refuses a folder "
        "whose step folders are all unusable (an empty folder: starts at step 0)")  # fmt: skip
    resume_or_start: bool = flag(False, "--resume, or start over when no checkpoint is "
        "intact, moving the unusable step folders and the old metrics file into "
        "DIR/corrupt/ (never deleted)")  # fmt: skip
    overwrite: bool = flag(False, "a fresh run into a used folder: delete its step_N folders "
        "and metrics first (without it such a rerun is refused)")  # fmt: skip
    on_nonfinite: str = flag("stop", "a NaN/inf loss or gradient norm: stop with "
        "DivergenceError (stop) or skip that optimizer step and continue (skip)",
        choices=NONFINITE_ACTIONS)  # fmt: skip
    metrics: str | None = flag(None, "JSON-lines metrics file (rank 0; appended to on resume)",
                               unset="none")  # fmt: skip
    plot: str | None = flag(None, "loss-curve PNG path",
                            unset="next to the metrics / checkpoints")  # fmt: skip
    tensorboard: bool = flag(False, "TensorBoard scalars under <checkpoint dir or metrics "
                             "folder>/tensorboard (needs boost-compiler[tensorboard])")  # fmt: skip
    peak_tflops: float | None = flag(None, "peak TFLOP/s per device for the MFU estimate",
        unset="known GPUs' dense datasheet figure for the run's dtype; none on CPU",
        metavar="X")  # fmt: skip
    bf16: bool = flag(False, "pure bf16: the model cast to bf16, no fp32 master weights, "
                      "AdamW moments and gradient reduction in bf16")  # fmt: skip
    mixed_precision: str = flag("none", "bf16: fp32 master weights and AdamW moments, bf16 "
        "compute, fp32 gradient reduction (FSDP2's MixedPrecisionPolicy, applied also at "
        "dp 1); not with --bf16, --no-fsdp or --pp > 1; none: every number fp32 (or --bf16's)",
        choices=MIXED_PRECISIONS)  # fmt: skip
    compile: bool = flag(True, "torch.compile(backend='boost'), or eager with --no-compile "
                         "(still BTP)")  # fmt: skip
    fsdp: bool = flag(True, "dp > 1: FSDP2, or plain gradient all-reduce with --no-fsdp")
    progress: bool = flag(True, "rich progress bar on rank 0")
    throttle: float = flag(0.0, "sleep per step, s (lets tests kill a run mid-way)")
    # Long enough for the slowest legitimate wait (a peer's first compile, rank 0
    # hashing a large checkpoint for its manifest), short enough that a dead peer
    # does not keep the others waiting for torch's default 30 minutes.
    comm_timeout: float = flag(600.0, "a collective waiting longer for its peers fails, and "
        "the run exits naming the lost rank (gloo/NCCL timeout)", metavar="SECONDS")  # fmt: skip
    log_every: int = flag(10, "log a line every K steps")

    def validate(self, world: int | None = None) -> None:
        """Raise :class:`TrainConfigError` naming the first inconsistent value."""
        self._validate_numbers()
        self._validate_run_folder()
        positive = ("tp", "pp", "microbatches", "steps", "batch", "seq")
        for name in positive:
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise TrainConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dp is not None and self.dp <= 0:
            raise TrainConfigError(f"dp must be positive, got {self.dp}")
        if self.stop_at is not None and not 0 < self.stop_at <= self.steps:
            raise TrainConfigError(
                f"stop_at must be in 1..steps ({self.steps}), got {self.stop_at}"
            )
        if self.save_every < 0 or self.warmup < 0 or self.clip < 0 or self.keep < 0:
            raise TrainConfigError("save_every, warmup, clip and keep must be >= 0")
        if world is not None:
            self._validate_world(world)
            dp = self.dp if self.dp is not None else world // (self.tp * self.pp)
            if dp * self.tp * self.pp != world:
                raise TrainConfigError(
                    f"pp ({self.pp}) x dp ({dp}) x tp ({self.tp}) must equal the world size "
                    f"({world})"
                )
            if self.batch % dp:
                raise TrainConfigError(
                    f"the global batch ({self.batch}) must divide by dp ({dp}): every dp rank "
                    "takes an equal, disjoint slice"
                )
            if self.pp > 1:
                self.micro_batches(dp)  # raises when the batch cannot be cut as asked
        self._validate_schedule()
        if self.comm_timeout <= 0:
            raise TrainConfigError(f"comm_timeout must be positive, got {self.comm_timeout}")
        if (self.resume or self.resume_or_start or self.save_every) and not self.checkpoint_dir:
            raise TrainConfigError(
                "--resume, --resume-or-start and --save-every need --checkpoint-dir"
            )
        self._validate_data()
        self._validate_precision()

    def _validate_precision(self) -> None:
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise TrainConfigError(
                f"--mixed-precision must be one of {', '.join(MIXED_PRECISIONS)}, "
                f"not {self.mixed_precision!r}"
            )
        if self.mixed_precision == "none":
            return
        if self.bf16:
            raise TrainConfigError(
                "--bf16 casts the model to bf16 (no fp32 master weights), --mixed-precision "
                "bf16 keeps fp32 master weights and computes in bf16: give one of them"
            )
        if not self.fsdp:
            raise TrainConfigError(
                "--mixed-precision bf16 is FSDP2's MixedPrecisionPolicy (fp32 master weights, "
                "bf16 compute, fp32 gradient reduction): drop --no-fsdp"
            )
        if self.pp > 1:
            # The stages' boundary activations would arrive in bf16, which the pipeline's
            # send/receive buffers (the parameters' dtype) do not yet follow.
            raise TrainConfigError(
                "--mixed-precision bf16 with --pp > 1 is not supported yet: use --pp 1, or "
                "--bf16 (pure bf16)"
            )

    def stages_per_rank(self) -> int:
        """Pipeline stages each pp rank runs: ``--virtual-stages``, else 2 for the
        interleaved schedules and 1 for the others."""
        from .schedules import MULTI

        if self.virtual_stages is not None:
            return self.virtual_stages
        return 2 if self.schedule in MULTI else 1

    def _validate_schedule(self) -> None:
        from ..errors import PipelineError
        from .schedules import SCHEDULES, check_schedule

        if self.schedule not in SCHEDULES:
            raise TrainConfigError(
                f"--schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}"
            )
        v = self.stages_per_rank()
        if self.schedule != "1f1b" or v != 1:
            try:  # what the schedule itself refuses, before anything is built
                check_schedule(self.schedule, self.pp, self.pp, v, self.compile)
            except PipelineError as err:
                raise TrainConfigError(str(err)) from None
        if self.pp_layers is not None and len(self.pp_layers) != self.pp * v:
            raise TrainConfigError(
                f"--pp-layers {','.join(map(str, self.pp_layers))} names {len(self.pp_layers)} "
                f"stage(s), --pp {self.pp} x {v} stage(s) per rank is {self.pp * v}: give one "
                "layer count per stage"
            )

    def micro_batches(self, dp: int) -> int:
        """Micro-batches per dp rank and step: ``--microbatches``, or by default the
        smallest divisor of the per-rank batch that is at least ``2 * pp`` (a 1F1B bubble
        of at most a third), else the smallest that is at least ``pp`` (what 1F1B needs)."""
        local = self.batch // dp
        if self.microbatches is not None:
            if local % self.microbatches:
                raise TrainConfigError(
                    f"the global batch ({self.batch}) must divide by dp x microbatches "
                    f"({dp} x {self.microbatches})"
                )
            return self.microbatches
        from .schedules import MULTI

        fits = [m for m in range(self.pp, local + 1) if local % m == 0]
        if self.schedule in MULTI:  # torch's interleaved schedules run m // pp whole rounds
            fits = [m for m in fits if m % max(1, m // self.pp) == 0]
        if not fits:
            raise TrainConfigError(
                f"--pp {self.pp} needs at least {self.pp} micro-batches per dp rank, but each "
                f"of the {dp} dp rank(s) has {local} sequence(s): raise --batch to at least "
                f"{self.pp * dp}"
            )
        return next((m for m in fits if m >= 2 * self.pp), fits[0])

    def _validate_numbers(self) -> None:
        """argparse's ``float`` takes ``nan`` and ``inf``: refuse them (and a negative lr) here,
        before a step trains on them."""
        floats = ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "clip", "rank_ratio",
                  "throttle", "comm_timeout", "eval_fraction", "peak_tflops")  # fmt: skip
        for name in floats:
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise TrainConfigError(
                    f"--{name.replace('_', '-')} must be a finite number, got {value}"
                )
        if self.lr < 0:
            raise TrainConfigError(f"--lr must be >= 0, got {self.lr}")
        if self.on_nonfinite not in NONFINITE_ACTIONS:
            raise TrainConfigError(
                f"--on-nonfinite must be one of {', '.join(NONFINITE_ACTIONS)}, "
                f"not {self.on_nonfinite!r}"
            )

    def _validate_run_folder(self) -> None:
        if self.overwrite and (self.resume or self.resume_or_start):
            raise TrainConfigError(
                "--overwrite deletes the folder's checkpoints, --resume continues from them: "
                "give one of them"
            )
        if self.overwrite and not (self.checkpoint_dir or self.metrics):
            raise TrainConfigError("--overwrite needs --checkpoint-dir or --metrics to clear")

    def _validate_world(self, world: int) -> None:
        """A layout wider than the processes there are: say so, and how to start them."""
        need = self.tp * self.pp * (self.dp or 1)
        if need <= world:
            return
        flags = " ".join(f"--{k} {v}" for k, v in (("pp", self.pp), ("dp", self.dp),
                                                    ("tp", self.tp)) if v not in (None, 1))  # fmt: skip
        if world == 1:
            raise TrainConfigError(
                f"{flags} needs {need} processes, but this is one process (world size 1: no "
                f"launcher started it): run it under torchrun, e.g. torchrun --standalone "
                f"--nproc-per-node {need} $(which boost) train {flags} ..."
            )
        raise TrainConfigError(
            f"{flags} needs {need} processes, but the world size is {world}: start "
            f"--nproc-per-node {need} processes (torchrun), or lower {flags}"
        )

    def _validate_data(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise TrainConfigError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.eval_fraction and self.eval_data:
            raise TrainConfigError("give --eval-fraction or --eval-data, not both")
        if (self.eval_fraction or self.tokenizer) and not self.data:
            raise TrainConfigError(
                "--eval-fraction and --tokenizer apply to --data files: the embedded corpus "
                "is byte tokens (give --data, or drop them)"
            )
        held_out = bool(self.eval_fraction or self.eval_data)
        if self.eval_every < 0 or self.eval_batches <= 0:
            raise TrainConfigError("eval_every must be >= 0 and eval_batches positive")
        if self.eval_every and not held_out:
            raise TrainConfigError("--eval-every needs a held-out split: --eval-fraction F or "
                                   "--eval-data PATH")  # fmt: skip
        if self.txt_unit not in TXT_UNITS:
            raise TrainConfigError(
                f"txt_unit must be file, paragraph or line, not {self.txt_unit!r}"
            )
        if not self.text_field:
            raise TrainConfigError("text_field must not be empty")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}
_ALIASES = {"model_name": "model", "max_grad_norm": "clip", "no_compile": "compile"}


def load_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as TrainConfig keyword arguments (unknown keys raise, naming them)."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise TrainConfigError(f"cannot read config {path}: {err}") from err
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = _ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
        if key == "model" and isinstance(value, dict):
            value = dict(value)
            if "preset" in value:
                out["model"] = value.pop("preset")
            name = "model_overrides"
        if name not in _FIELDS:
            raise TrainConfigError(f"unknown key {key!r} in {path}; known: {sorted(_FIELDS)}")
        if key in ("no_compile", "no-compile"):
            value = not value
        out[name] = value
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The training flags, generated from :class:`TrainConfig`'s fields (every default
    suppressed: see the module docstring)."""
    p.add_argument("--config", default=None, help="TOML file; flags given here win over it")
    add_dataclass_flags(p, TrainConfig)


def from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then ``--config`` TOML, then the flags that were given."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_toml(args.config))
    for name, value in vars(args).items():
        if name in _FIELDS:
            values[name] = value
    try:
        return TrainConfig(**values)
    except TypeError as err:
        raise TrainConfigError(str(err)) from err
