"""Model FLOPs utilisation (MFU): the FLOPs a step must do, over what the devices could do.

``MFU = F x tokens/s / (devices x peak FLOP/s)``, with ``F`` the model FLOPs per token of
one training step (forward and backward), counted from the model's shapes rather than
measured, so that it is comparable across layouts and with published MFUs:

- **GEMMs, counted exactly from the parameters**: ``6 x P``, where ``P`` is the number of
  elements of the weight matrices a token goes through (forward 2 FLOPs per element, a
  multiply and an add; backward 4, the input's and the weight's gradient). For the
  low-rank model this is the exact GEMM count, not the dense estimate: each factor of a
  projection is a matrix applied to every token, so a projection costs
  ``6 (d_in r + r d_out)``, the same numbers as the cost model's per-layer GEMMs
  (``costmodel.formulas()["btp"].gemms``, 2MKN per rank, times tp), but read off the
  parameters so that it holds for every model the trainer builds (Hugging Face ones too).
  ``P`` leaves out embedding tables (a lookup, no FLOPs) unless one is tied to the LM head
  (counted once, as the head's matrix) and every vector (norms, biases: O(d) per token).
- **The attention core, estimated**: ``12 L d_attn s`` (``QK^T`` and ``AV``: ``2 s d_attn``
  FLOPs each per token and layer forward, three times that with the backward), with
  ``d_attn`` = heads x head size and ``s`` = ``--seq``. Like PaLM's appendix B and
  Megatron's MFU it ignores the causal mask (which would halve it), so the numbers compare.

Not counted: softmax, activations, rotary, the loss (all O(d) or O(V) per token). The
count is high for models that skip work per token (mixture-of-experts, sliding windows).

The peak is ``--peak-tflops`` per device, else the dense (no sparsity) datasheet number
of a known NVIDIA accelerator for the run's matmul dtype; on CPU or an unknown device
there is none and MFU is "n/a".
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._logging import get_logger
from ..errors import TrainConfigError

log = get_logger(__name__)

# Dense (no 2:4 sparsity) tensor-core TFLOP/s per device from NVIDIA's datasheets, by the
# matmul dtype: bf16 (--bf16), tf32 (fp32 tensors under torch.set_float32_matmul_precision
# "high"/"medium"), fp32 (torch's default "highest": no tensor cores). Matched on the words
# of torch.cuda.get_device_name(): (chip, variant or None); the first match wins, so a
# variant (PCIe, NVL) precedes its chip's SXM entry. A100 PCIe and SXM share one number.
_H100_SXM = {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}
_NVL = {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}
PEAK_TFLOPS: tuple[tuple[str, str | None, Mapping[str, float]], ...] = (
    ("H100", "PCIE", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100", "NVL", _NVL),
    ("H100", None, _H100_SXM),
    ("H200", "NVL", _NVL),
    ("H200", None, _H100_SXM),  # same compute as the H100 SXM, more memory
    ("GH200", None, _H100_SXM),
    ("A100", None, {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", None, {"bf16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    ("L40", None, {"bf16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    ("L4", None, {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
)


def known_peak_tflops(device_name: str, dtype: str) -> float | None:
    """The table's TFLOP/s for ``device_name`` at ``dtype`` (bf16/tf32/fp32), None if unknown.

    Whole words only: "NVIDIA L40S" is not an "L4", "NVIDIA H100 PCIe" not the SXM part.
    """
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    for chip, variant, peaks in PEAK_TFLOPS:
        if chip in words and (variant is None or variant in words):
            return peaks.get(dtype)
    return None


def matmul_dtype(bf16: bool) -> str:
    """The dtype the run's GEMMs execute in, which decides the peak."""
    if bf16:
        return "bf16"
    # fp32 GEMMs use TF32 tensor cores only when the user lowered the matmul precision.
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


@dataclass(frozen=True)
class Peak:
    """FLOP/s per device that MFU is measured against, and where the number came from."""

    tflops: float | None
    source: str


def resolve_peak(peak_tflops: float | None, device: torch.device, bf16: bool) -> Peak:
    """``--peak-tflops`` if given, else the table's entry for a CUDA device, else none."""
    if peak_tflops is not None:
        if not (peak_tflops > 0 and math.isfinite(peak_tflops)):
            raise TrainConfigError(f"--peak-tflops must be a positive number, got {peak_tflops}")
        return Peak(float(peak_tflops), "--peak-tflops")
    if device.type != "cuda":
        # A CPU's peak depends on its cores, clock and vector units: no default is honest.
        return Peak(None, f"no default peak on {device.type} (give --peak-tflops)")
    name, dtype = torch.cuda.get_device_name(device), matmul_dtype(bf16)
    tflops = known_peak_tflops(name, dtype)
    if tflops is None:
        log.warning("no known %s peak for %r: MFU is n/a (give --peak-tflops)", dtype, name)
        return Peak(None, f"unknown accelerator {name!r} ({dtype})")
    return Peak(tflops, f"{name}, {dtype} dense (datasheet)")


def embedding_weights(model: nn.Module) -> set[str]:
    """Parameter names of the model's embedding tables (lookups, no FLOPs)."""
    return {
        f"{name}.weight" if name else "weight"
        for name, module in model.named_modules(remove_duplicate=False)
        if isinstance(module, nn.Embedding)
    }


def matmul_params(
    shapes: Mapping[str, tuple[int, ...]],
    aliases: Mapping[str, str] | None = None,
    embeddings: set[str] | frozenset[str] = frozenset(),
) -> int:
    """Elements of the weight matrices a token multiplies through (``P`` above).

    ``shapes``: each distinct parameter's global shape by its first name; ``aliases``: tied
    name -> first name (a tied table counts once, and only if one of its names is not an
    embedding, i.e. it is also the LM head).
    """
    names: dict[str, set[str]] = {name: {name} for name in shapes}
    for alias, first in (aliases or {}).items():
        names.setdefault(first, {first}).add(alias)
    total = 0
    for name, shape in shapes.items():
        if len(shape) < 2 or names[name] <= embeddings:
            continue
        total += math.prod(shape)
    return total


def attention_dims(model: nn.Module) -> tuple[int, int] | None:
    """(layers, heads x head size) of the whole model as its family's spec says
    (:meth:`.model_spec.ModelSpec.attention_dims`; a pipeline stage answers for the whole
    model), or None when no registered family owns it or it does not say."""
    from .families import SPECS

    for spec in SPECS:
        if spec.owns(model):
            return spec.attention_dims(model)
    return None


def flops_per_token(params: int, layers: int, attn_width: int, seq: int) -> int:
    """Training FLOPs per token: ``6 P + 12 L d_attn s`` (see the module docstring)."""
    return 6 * params + 12 * layers * attn_width * seq


def mfu(
    tokens_per_s: float, flops_per_tok: float, devices: int, peak_tflops: float | None
) -> float | None:
    """Achieved model FLOP/s over ``devices x peak``; None without a peak."""
    if peak_tflops is None or devices <= 0:
        return None
    return flops_per_tok * tokens_per_s / (devices * peak_tflops * 1e12)


@dataclass(frozen=True)
class MFUMeter:
    """One run's constants: ``meter(tokens_per_s)`` is that step's MFU (None: no peak)."""

    flops_per_token: int
    devices: int
    peak: Peak

    def __call__(self, tokens_per_s: float) -> float | None:
        return mfu(tokens_per_s, self.flops_per_token, self.devices, self.peak.tflops)

    def record(self) -> dict[str, Any]:
        """For the metrics' start record: what every step's ``mfu`` was computed from."""
        return {"flops_per_token": self.flops_per_token, "mfu_devices": self.devices,
                "peak_tflops_per_device": self.peak.tflops,
                "peak_source": self.peak.source}  # fmt: skip


def for_run(run: Any) -> MFUMeter:
    """The meter of the loop's ``_Run``; with ``--pp > 1`` a collective over the pp group.

    The parameters are the run's checkpoint layout (global shapes, so the TP blocks and
    FSDP2 shards count whole); a pipeline stage holds only its own layers, so the stages'
    counts are summed over pp (stages are disjoint; tied embeddings are refused at pp > 1).
    """
    cfg, layout = run.cfg, run.layout
    shapes = {e.name: tuple(int(n) for n in e.global_shape) for e in layout.entries}
    params = matmul_params(shapes, layout.aliases, embedding_weights(run.model))
    if run.pipe is not None:
        total = torch.tensor([params], dtype=torch.int64, device=run.device)
        dist.all_reduce(total, group=run.mesh["pp"].get_group())
        params = int(total.item())
    dims = run.spec.attention_dims(run.model)  # the family's (.model_spec)
    if dims is None:
        log.warning("the model's spec gives no attention size: MFU leaves out the attention core")
        dims = (0, 0)
    flops = flops_per_token(params, dims[0], dims[1], cfg.seq)
    # --mixed-precision bf16 computes its GEMMs in bf16 as --bf16 does: the same peak.
    peak = resolve_peak(cfg.peak_tflops, run.device, cfg.bf16 or cfg.mixed_precision == "bf16")
    return MFUMeter(flops, dist.get_world_size(), peak)
