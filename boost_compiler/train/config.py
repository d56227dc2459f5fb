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

from ..errors import TrainConfigError


@dataclass
class TrainConfig:
    """Everything that defines a training run. ``batch`` is the GLOBAL batch (all dp ranks)."""

    # A preset in boost_compiler.models.cola_llama.CONFIGS, or a user's "module:function"
    # (train/spec_module.py); which family trains is train/families.py's choice.
    model: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)  # TOML [model] table
    # Hugging Face models instead of the preset (train/hf_model.py).
    hf_config: str | None = None  # a transformers config folder: that model, made low-rank
    init_from: str | None = None  # a dense HF checkpoint folder: its weights, SVD-factored
    # --init-from's low-rank layout (cola, cola-m, loro, sltrain, boost-nanotron; "hf": boost's
    # own or a dense folder); None: detected from the folder (boost_compiler/layouts).
    layout: str | None = None
    low_rank_method: str | None = None  # "cola" / "svd"; None: cola (hf_config), svd (init_from)
    rank_ratio: float = 0.25  # r = floor(ratio * min(d_in, d_out)) to a multiple of rank_multiple
    rank: int | None = None  # or this r for every converted layer
    # Not the tp degree: the layout must be the same at every (dp, tp) for checkpoints to move.
    rank_multiple: int = 8
    tp: int = 1
    dp: int | None = None  # None: world size // (tp * pp)
    pp: int = 1  # pipeline stages (train/pipeline.py), 1F1B over `microbatches`
    microbatches: int | None = None  # per dp rank and step, when pp > 1; None: see micro_batches
    pp_layers: tuple[int, ...] | None = None  # decoder layers per stage; None: as even as can be
    schedule: str = "1f1b"  # 1f1b, gpipe, interleaved-1f1b, zero-bubble (train/schedules.py)
    virtual_stages: int | None = None  # stages per pp rank; None: 2 for the interleaved ones
    steps: int = 100
    stop_at: int | None = None  # leave after this many steps (schedule still over `steps`)
    batch: int = 8  # sequences per optimizer step, summed over the dp ranks
    seq: int = 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup: int = 10  # linear warm-up steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    clip: float = 1.0  # max global gradient norm; 0 disables clipping (the norm is still logged)
    seed: int = 0
    data: list[str] | None = None  # .txt/.jsonl/.parquet files or folders; None: embedded corpus
    tokenizer: str | None = None  # tokenizer.json or a transformers folder; None: UTF-8 bytes
    text_field: str = "text"  # the jsonl / parquet field that holds a document
    txt_unit: str = "file"  # one .txt document: "file", "paragraph" or "line"
    eos_token: str | None = None  # the document separator; None: the tokenizer's own
    eval_fraction: float = 0.0  # hold out this fraction of the --data documents
    eval_data: list[str] | None = None  # or validate on these files
    eval_every: int = 0  # validation loss every K steps (0: at the last step only)
    eval_batches: int = 4  # global batches in the held-out set
    checkpoint_dir: str | None = None
    save_every: int = 0  # 0: save only at the end (when checkpoint_dir is set)
    keep: int = 0  # keep the newest N checkpoints (0: all)
    allow_schedule_change: bool = False  # --resume with another lr schedule than the checkpoint's
    resume: bool = False
    # --resume, or start over when the folder holds no intact checkpoint (the unusable
    # step folders and the old metrics file are moved into DIR/corrupt/, never deleted).
    resume_or_start: bool = False
    overwrite: bool = False  # a fresh run into a used folder: delete its step_N and metrics
    on_nonfinite: str = "stop"  # a NaN/inf loss or grad norm: "stop" (DivergenceError) or "skip"
    metrics: str | None = None  # JSON lines file (appended to on resume)
    plot: str | None = None  # loss-curve PNG; default: next to the metrics / checkpoints
    tensorboard: bool = False  # scalars under <run folder>/tensorboard (the tensorboard extra)
    peak_tflops: float | None = None  # per device, for MFU; None: known GPUs' datasheet peak
    bf16: bool = False  # pure bf16: the model itself is cast (no fp32 master weights)
    # "bf16": FSDP2's MixedPrecisionPolicy (fp32 master weights and AdamW moments, bf16
    # compute, fp32 gradient reduction); "none": every number fp32 (or --bf16's).
    mixed_precision: str = "none"
    compile: bool = True  # torch.compile(backend="boost"); False: eager (still BTP)
    fsdp: bool = True  # dp > 1: FSDP2 across dp; False: gradient all-reduce
    progress: bool = True
    throttle: float = 0.0  # seconds of sleep per step: lets tests kill a run mid-way
    # Seconds a collective may wait for its peers before it fails (gloo/NCCL timeout).
    # Long enough for the slowest legitimate wait (a peer's first compile, rank 0
    # hashing a large checkpoint for its manifest), short enough that a dead peer
    # does not keep the others waiting for torch's default 30 minutes.
    comm_timeout: float = 600.0
    log_every: int = 10

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
        if self.txt_unit not in ("file", "paragraph", "line"):
            raise TrainConfigError(
                f"txt_unit must be file, paragraph or line, not {self.txt_unit!r}"
            )
        if not self.text_field:
            raise TrainConfigError("text_field must not be empty")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


NONFINITE_ACTIONS = ("stop", "skip")
MIXED_PRECISIONS = ("none", "bf16")
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
    """The training flags (every default suppressed: see the module docstring)."""
    s = argparse.SUPPRESS
    p.add_argument("--config", default=None, help="TOML file; flags given here win over it")
    p.add_argument(
        "--model",
        default=s,
        help="CoLA-LLaMA preset: tiny, 60m, 1b, 7b, 40b (tiny), "
        "or pkg.module:function / file.py:function building your own model",
    )
    p.add_argument("--hf-config", default=s, metavar="DIR",
                   help="train a Hugging Face model from DIR/config.json (transformers' own "
                   "class), made low-rank by to_low_rank, instead of --model")  # fmt: skip
    p.add_argument("--init-from", default=s, metavar="DIR",
                   help="start from a dense Hugging Face checkpoint folder (config.json + "
                   "safetensors), SVD-factored; a boost export --format hf folder, or another "
                   "project's low-rank checkpoint (--layout), as it is")  # fmt: skip
    p.add_argument("--layout", default=s,
                   choices=("hf", "cola", "cola-m", "loro", "sltrain", "boost-nanotron"),
                   help="--init-from's layout: CoLA, CoLA-M, LORO, SLTrain or the BOOST "
                   "reference's Nanotron checkpoint, imported as factor pairs; hf: a Hugging "
                   "Face folder (default: detected from the folder)")  # fmt: skip
    p.add_argument("--low-rank-method", choices=("cola", "svd"), default=s,
                   help="to_low_rank method (cola for --hf-config, svd for --init-from)")  # fmt: skip
    p.add_argument("--rank-ratio", type=float, default=s,
                   help="rank = ratio x min(d_in, d_out) of each projection (0.25)")  # fmt: skip
    p.add_argument("--rank", type=int, default=s, help="one rank for every projection")
    p.add_argument("--rank-multiple", type=int, default=s,
                   help="ranks rounded down to a multiple of N, for tp degrees dividing it (8)")  # fmt: skip
    p.add_argument("--tp", type=int, default=s, help="tensor-parallel degree (BTP) (1)")
    p.add_argument("--dp", type=int, default=s, help="data-parallel degree (world / tp / pp)")
    p.add_argument("--pp", type=int, default=s,
                   help="pipeline stages (--schedule), each stage compiled unless --no-compile; "
                   "checkpoints load at any (pp, dp, tp) (1)")  # fmt: skip
    p.add_argument("--microbatches", type=int, default=s,
                   help="micro-batches per dp rank and step, with --pp (the smallest divisor "
                   "of the per-rank batch >= 2 x pp, else >= pp)")  # fmt: skip
    p.add_argument("--pp-layers", type=_layer_counts, default=s, metavar="N,N,...",
                   help="decoder layers of each pipeline stage, e.g. 3,5 (default: an even "
                   "split, extra layers to the middle stages)")  # fmt: skip
    p.add_argument("--schedule", choices=("1f1b", "gpipe", "interleaved-1f1b", "zero-bubble"),
                   default=s, help="pipeline schedule, torch.distributed.pipelining's; the "
                   "last two run --virtual-stages stages per rank (1f1b)")  # fmt: skip
    p.add_argument("--virtual-stages", type=int, default=s, metavar="V",
                   help="stages per pp rank for interleaved-1f1b / zero-bubble (2)")  # fmt: skip
    p.add_argument("--steps", type=int, default=s, help="optimizer steps in total (100)")
    p.add_argument("--stop-at", type=int, default=s,
                   help="leave after this many steps, keeping the --steps schedule "
                   "(a time-limited job; rerun with --resume)")  # fmt: skip
    p.add_argument("--batch", type=int, default=s, help="GLOBAL batch in sequences (8)")
    p.add_argument("--seq", type=int, default=s, help="sequence length in tokens (64)")
    p.add_argument("--lr", type=float, default=s, help="peak learning rate (3e-3)")
    p.add_argument("--warmup", type=int, default=s, help="linear warm-up steps (10)")
    p.add_argument("--min-lr-ratio", type=float, default=s, help="final lr / peak lr (0.1)")
    p.add_argument("--weight-decay", type=float, default=s, help="AdamW weight decay (0.1)")
    p.add_argument("--clip", type=float, default=s, help="max global grad norm, 0: off (1.0)")
    p.add_argument("--seed", type=int, default=s, help="model init and data order (0)")
    p.add_argument("--data", nargs="+", default=s, metavar="PATH",
                   help=".txt, .jsonl, .parquet files or folders, streamed in order "
                   "(default: the embedded corpus)")  # fmt: skip
    p.add_argument("--tokenizer", default=s, metavar="PATH",
                   help="tokenizer.json, or a local transformers tokenizer folder; the model's "
                   "vocab is sized from it (default: UTF-8 bytes)")  # fmt: skip
    p.add_argument("--text-field", default=s, help="jsonl / parquet field of the text (text)")
    p.add_argument("--txt-unit", choices=("file", "paragraph", "line"), default=s,
                   help="one document of a .txt file (file)")  # fmt: skip
    p.add_argument("--eos-token", default=s,
                   help="token put between documents (the tokenizer's EOS, e.g. </s>)")  # fmt: skip
    p.add_argument("--eval-fraction", type=float, default=s,
                   help="hold out this fraction of the --data documents for validation (0)")  # fmt: skip
    p.add_argument("--eval-data", nargs="+", default=s, metavar="PATH",
                   help="validate on these files instead")  # fmt: skip
    p.add_argument("--eval-every", type=int, default=s,
                   help="validation loss and perplexity every K steps (0: last step only)")  # fmt: skip
    p.add_argument("--eval-batches", type=int, default=s, help="global batches validated (4)")
    p.add_argument("--checkpoint-dir", default=s, help="DCP checkpoints go to DIR/step_N")
    p.add_argument("--save-every", type=int, default=s, help="checkpoint every K steps")
    p.add_argument("--resume", action="store_true", default=s,
                   help="continue from DIR's newest intact checkpoint; refuses a folder whose "
                   "step folders are all unusable (an empty folder: starts at step 0)")  # fmt: skip
    p.add_argument("--resume-or-start", action="store_true", default=s,
                   help="--resume, or start over when no checkpoint is intact, moving the "
                   "unusable step folders and the old metrics file into DIR/corrupt/")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", default=s,
                   help="a fresh run into a used folder: delete its step_N folders and "
                   "metrics first (without it such a rerun is refused)")  # fmt: skip
    p.add_argument("--on-nonfinite", choices=NONFINITE_ACTIONS, default=s,
                   help="a NaN/inf loss or gradient norm: stop with DivergenceError (stop, "
                   "the default) or skip that optimizer step and continue (skip)")  # fmt: skip
    p.add_argument("--keep", type=int, default=s, help="keep the newest N checkpoints (all)")
    p.add_argument("--allow-schedule-change", action="store_true", default=s,
                   help="--resume with other --steps/--lr/--warmup/--min-lr-ratio than saved")  # fmt: skip
    p.add_argument("--metrics", default=s, help="JSON-lines metrics file (rank 0)")
    p.add_argument("--plot", default=s, help="loss-curve PNG path")
    p.add_argument("--tensorboard", action="store_true", default=s,
                   help="TensorBoard scalars under <checkpoint dir or metrics folder>/"
                   "tensorboard (needs boost-compiler[tensorboard])")  # fmt: skip
    p.add_argument("--peak-tflops", type=float, default=s, metavar="X",
                   help="peak TFLOP/s per device for the MFU estimate (default: known GPUs' "
                   "dense datasheet figure for the run's dtype; none on CPU)")  # fmt: skip
    p.add_argument("--bf16", action="store_true", default=s,
                   help="pure bf16: the model cast to bf16, no fp32 master weights, AdamW "
                   "moments and gradient reduction in bf16")  # fmt: skip
    p.add_argument("--mixed-precision", choices=MIXED_PRECISIONS, default=s,
                   help="bf16: fp32 master weights and AdamW moments, bf16 compute, fp32 "
                   "gradient reduction (FSDP2's MixedPrecisionPolicy, applied also at dp 1); "
                   "not with --bf16, --no-fsdp or --pp > 1 (none)")  # fmt: skip
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=s,
                   help="torch.compile(backend='boost') (default) or eager (--no-compile)")  # fmt: skip
    p.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=s,
                   help="dp > 1: FSDP2 (default) or plain gradient all-reduce (--no-fsdp)")  # fmt: skip
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=s,
                   help="rich progress bar on rank 0 (default on)")  # fmt: skip
    p.add_argument("--throttle", type=float, default=s, help="sleep per step, s (tests)")
    p.add_argument("--comm-timeout", type=float, default=s, metavar="SECONDS",
                   help="a collective waiting longer for its peers fails, and the run exits "
                   "naming the lost rank (600)")  # fmt: skip
    p.add_argument("--log-every", type=int, default=s, help="log a line every K steps (10)")


def _layer_counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--pp-layers takes comma-separated layer counts, e.g. 3,5; got {text!r}"
        ) from None


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
