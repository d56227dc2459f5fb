"""Hugging Face models in ``boost train`` (``--hf-config``, ``--init-from``) and out of it
(``boost export --format hf``).

* ``--hf-config DIR``: transformers' own class for ``DIR/config.json`` (its ``model_type``;
  never code from the folder), built with ``from_config`` under the run's seed, the
  ``[model]`` TOML table applied to the config first, then made low-rank by
  ``to_low_rank`` (``--low-rank-method``, default ``cola``; ``--rank-ratio``, ``--rank``,
  ``--rank-multiple``).
* ``--init-from DIR``: a dense checkpoint folder (``config.json`` + safetensors) loaded by
  :func:`boost_compiler.from_pretrained` (transformers' ``from_pretrained``, local files,
  safetensors only), converted by SVD. A folder ``boost export --format hf`` wrote is
  low-rank already and is trained on as it is, and so is another project's low-rank
  checkpoint (``--layout`` cola, cola-m, loro, sltrain, boost-nanotron, or detected from the
  folder: :mod:`boost_compiler.layouts`), imported as factor pairs; ``boost export --format
  <layout>`` (:func:`export_layout`) writes the trained model back in that layout.

The trainer asks :class:`HFSpec` (this family's :class:`~.model_spec.ModelSpec`) and
treats the model as it treats the CoLA-LLaMA (BTP over ``tp`` with the loss in the graph,
FSDP2 over ``dp``; at ``--pp > 1`` the model is cut into stages by decoder layer,
:mod:`.pipeline_hf`, which names the families it splits); only the call differs, HF's
``model(ids, labels=ids, use_cache=False).loss`` (:class:`LossForward`). The checkpoint's
``train_state.json`` keeps the model's config with its low-rank layout
(:data:`STATE_KEY`), so :func:`export_hf` needs nothing but the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._logging import get_logger
from ..errors import BoostError, ConversionError, HFFolderError, RemoteCodeError, VocabSizeError
from ..hf_io import LOW_RANK_KEY, read_layout, record_layout, write_folder
from .config import TrainConfig, TrainConfigError
from .model_spec import ModelSpec, same_on_every_rank
from .stages import StageSpec

log = get_logger(__name__)

STATE_KEY = "hf_model_config"  # train_state.json: the model's transformers config (a dict)
# Training calls: HF's cache would return every layer's keys and values, which the
# parallel model gathers to full width only for training to throw them away.
EXAMPLE_KWARGS: dict[str, Any] = {"use_cache": False}
# The config.json model_types boost train takes: the decoder-only causal LMs whose
# parallelized training the zoo checks (tests/zoo_checks.py). transformers maps more
# types to a "causal LM" class (BERT's masked encoder, Mamba's state space), which
# would train as something else or fail deep inside transformers.
SUPPORTED_MODEL_TYPES = (
    "llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2",
    "gpt_neox", "granite", "cohere", "stablelm", "starcoder2", "gpt2", "mixtral", "qwen3_moe",
    "deepseek_v3",
)  # fmt: skip


def is_hf(cfg: TrainConfig) -> bool:
    return bool(cfg.hf_config or cfg.init_from)


def check(cfg: TrainConfig) -> None:
    """The HF flags' own consistency (:class:`TrainConfigError` naming the flag)."""
    if not is_hf(cfg):
        return
    if cfg.hf_config and cfg.init_from:
        raise TrainConfigError(
            "give --hf-config (a fresh model) or --init-from (a checkpoint's weights), not both"
        )
    if cfg.layout is not None and not cfg.init_from:
        raise TrainConfigError("--layout names --init-from's layout: give --init-from DIR too")
    if cfg.low_rank_method not in (None, "cola", "svd"):
        raise TrainConfigError(
            f"--low-rank-method must be cola or svd, not {cfg.low_rank_method!r}"
        )
    if cfg.init_from and cfg.low_rank_method == "cola":
        raise TrainConfigError(
            "--init-from with --low-rank-method cola would draw new factors and throw the "
            "checkpoint's weights away: use svd (the default)"
        )
    if cfg.init_from and cfg.model_overrides:
        raise TrainConfigError(
            "a [model] table changes the architecture, which --init-from's weights fix: drop "
            "it (or use --hf-config)"
        )
    if cfg.rank_multiple < 1 or (cfg.rank is not None and cfg.rank % cfg.rank_multiple):
        raise TrainConfigError(
            f"--rank ({cfg.rank}) must be a multiple of --rank-multiple ({cfg.rank_multiple}), "
            "which must be >= 1"
        )
    folder = Path(cfg.hf_config or cfg.init_from or "")
    flag = "--hf-config" if cfg.hf_config else "--init-from"
    if cfg.init_from and _layout_of(cfg) not in (None, "hf"):
        return  # another project's layout: read as JSON and safetensors, its own checks
    if not (folder / "config.json").is_file():
        raise TrainConfigError(
            f"{flag} {folder}: no config.json there (a Hugging Face model folder)"
        )
    _check_model_type(folder, flag)
    from ..hf_io import refuse_remote_code

    refuse_remote_code(folder)  # auto_map: the folder's own code would be imported


def _layout_of(cfg: TrainConfig) -> str | None:
    """--init-from's layout: as given, else what the folder shows (None: a Hugging Face one)."""
    if cfg.layout is not None:
        return cfg.layout
    from ..layouts import detect

    folder = Path(cfg.init_from or "")
    if not folder.is_dir():
        raise TrainConfigError(f"--init-from {folder}: no such folder")
    try:
        return detect(folder)
    except RemoteCodeError:
        raise  # its own name: the folder asks for code boost never runs
    except BoostError as err:
        raise TrainConfigError(f"--init-from {folder}: {err}") from err


def _check_model_type(folder: Path, flag: str) -> None:
    """Refuse, by name and before transformers is imported, a family not in the list."""
    try:
        kind = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise TrainConfigError(f"{flag} {folder}/config.json is not a JSON object: {err}") from err
    if kind not in SUPPORTED_MODEL_TYPES:
        raise TrainConfigError(
            f"{flag} {folder}: model_type {kind!r} is not a decoder-only causal LM family "
            f"boost train supports; supported model_type values: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise TrainConfigError(
            "--hf-config / --init-from need the [hf] extra (pip install 'boost-compiler[hf]')"
        ) from err
    return transformers


def _check_sizes(config: Any, cfg: TrainConfig) -> None:
    from .data import model_vocab

    need = model_vocab(cfg) or 256  # without --tokenizer the tokens are bytes
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < need:
        what = f"the tokenizer's {need} ({cfg.tokenizer})" if cfg.tokenizer else "256 byte tokens"
        raise VocabSizeError(
            f"the model's vocab_size {vocab} cannot hold {what}: give a config with a larger "
            "vocab_size (or a [model] vocab_size with --hf-config)"
        )
    positions = getattr(config, "max_position_embeddings", None)
    positions = positions or getattr(config, "n_positions", None)
    if positions is not None and cfg.seq > int(positions):
        raise TrainConfigError(
            f"--seq {cfg.seq} exceeds the model's {positions} positions "
            "(max_position_embeddings / n_positions)"
        )


def _convert(model: nn.Module, cfg: TrainConfig, method: str) -> None:
    from ..convert import to_low_rank

    try:
        report = to_low_rank(
            model, rank=cfg.rank, rank_ratio=cfg.rank_ratio, method=method,
            multiple_of=cfg.rank_multiple,
        )  # fmt: skip
    except BoostError:
        raise
    except ValueError as err:  # to_low_rank's argument checks
        raise TrainConfigError(f"--rank / --rank-ratio / --rank-multiple: {err}") from err
    if not report.layers:  # (to_low_rank logs what it converted)
        raise TrainConfigError(
            f"to_low_rank converted no layer of {type(model).__name__} (--rank-ratio "
            f"{cfg.rank_ratio}, --rank-multiple {cfg.rank_multiple}): nothing for BTP to split"
        )


def build(cfg: TrainConfig) -> nn.Module:
    """The run's transformers model, low-rank, identical on every rank, in training mode."""
    tf = _transformers()
    check(cfg)
    torch.manual_seed(cfg.seed)
    if cfg.hf_config:
        config = tf.AutoConfig.from_pretrained(cfg.hf_config, local_files_only=True,
                                               trust_remote_code=False)  # fmt: skip
        if LOW_RANK_KEY in config.to_dict():
            # A boost export's config: its factors were for its own weights; new ones are drawn.
            log.warning("--hf-config %s: its %s is replaced by this run's conversion",
                        cfg.hf_config, LOW_RANK_KEY)  # fmt: skip
            delattr(config, LOW_RANK_KEY)
        config.update(dict(cfg.model_overrides))
        _check_sizes(config, cfg)
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                    trust_remote_code=False)  # fmt: skip
        method = cfg.low_rank_method or "cola"
        _convert(model, cfg, method)
        record_layout(model, method)
    else:
        from ..layouts import from_pretrained

        model = from_pretrained(str(cfg.init_from), layout=cfg.layout, dtype=torch.float32)
        _check_sizes(model.config, cfg)
        if read_layout(model.config) is not None:
            log.info("--init-from %s is low-rank already (%s): trained as it is", cfg.init_from,
                     LOW_RANK_KEY)  # fmt: skip
        else:
            try:
                _convert(model, cfg, "svd")
            except ConversionError as err:  # a weight the SVD cannot take: say whose folder
                raise ConversionError(f"--init-from {cfg.init_from}: {err}") from err
            record_layout(model, "svd")
    model.train()  # from_pretrained returns eval mode; dropout as the config says
    same_on_every_rank(model)
    return model


class LossForward:
    """``forward(ids, labels=ids)`` -> the loss, for a transformers causal LM (or its
    compiled form): the call the training loop and validation make."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward

    def __call__(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.forward(ids, labels=labels, **EXAMPLE_KWARGS).loss


def config_record(model: nn.Module) -> dict[str, Any]:
    """The model's transformers config as JSON values (its low-rank layout included)."""
    return json.loads(model.config.to_json_string(use_diff=False))  # type: ignore[operator]


def export_hf(checkpoint: str | Path, out: str | Path, *, overwrite: bool = False
              ) -> dict[str, Any]:  # fmt: skip
    """``boost export --format hf``: the checkpoint's model as a folder that
    :func:`boost_compiler.from_pretrained` (and transformers, for the weights) loads.
    ``out``: a new or empty folder, or with ``overwrite`` one whose model files are
    replaced; never a training run's folder (checked before the checkpoint is read)."""
    from ..output_folder import check_output_folder
    from .checkpoint import single_device_state_dict

    check_output_folder(out, overwrite=overwrite)
    sd, state = single_device_state_dict(checkpoint)
    config = state.get(STATE_KEY)
    if config is None:
        raise HFFolderError(
            f"{checkpoint}: a checkpoint of the packaged CoLA-LLaMA, not of a transformers model "
            "(--hf-config / --init-from): export it with --format safetensors"
        )
    folder = write_folder(out, config, sd, overwrite=overwrite)
    return {"path": str(folder), "step": state["step"], "tensors": len(sd),
            "numel": sum(t.numel() for t in sd.values())}  # fmt: skip


def export_layout(checkpoint: str | Path, out: str | Path, layout: str, *,
                  overwrite: bool = False) -> dict[str, Any]:  # fmt: skip
    """``boost export --format <layout>``: the checkpoint's model in another project's
    low-rank layout (:mod:`boost_compiler.layouts`: CoLA, CoLA-M, LORO, SLTrain, the BOOST
    reference's Nanotron), for a run of ``--hf-config`` / ``--init-from``; ``out`` and
    ``overwrite`` as :func:`export_hf`."""
    from ..errors import LayoutError
    from ..layouts import write
    from ..output_folder import check_output_folder
    from .checkpoint import single_device_state_dict

    check_output_folder(out, overwrite=overwrite, error=LayoutError)
    sd, state = single_device_state_dict(checkpoint)
    config = state.get(STATE_KEY)
    if config is None:
        raise HFFolderError(
            f"{checkpoint}: a checkpoint of the packaged CoLA-LLaMA, not of a transformers model "
            f"(--hf-config / --init-from): --format {layout} writes transformers models only"
        )
    folder = write(out, layout, config, sd, overwrite=overwrite)
    return {"path": str(folder), "step": state["step"], "tensors": len(sd),
            "numel": sum(t.numel() for t in sd.values())}  # fmt: skip


class HFSpec(ModelSpec):
    """``--hf-config`` / ``--init-from``: a transformers causal LM, made low-rank."""

    name = "transformers"
    pipeline_masks = True

    def claims(self, cfg: TrainConfig) -> bool:
        return is_hf(cfg)

    def owns(self, model: nn.Module) -> bool:
        # A PretrainedConfig as .config: the whole model and its stages (pipeline_hf).
        return hasattr(getattr(model, "config", None), "model_type")

    def check(self, cfg: TrainConfig) -> None:
        check(cfg)

    def build(self, cfg: TrainConfig) -> nn.Module:
        return build(cfg)

    def example_kwargs(self) -> dict[str, Any]:
        return dict(EXAMPLE_KWARGS)

    def loss_forward(self, forward: Any) -> Any:
        return LossForward(forward)  # HF returns an output object: the loop wants its loss

    def pipeline_dims(self, model: nn.Module) -> tuple[int, int, bool]:
        from .pipeline_hf import hf_dims

        return hf_dims(model)

    def stage(self, model: nn.Module, spec: StageSpec, boundary_group: str | None) -> nn.Module:
        from .pipeline_hf import hf_stage

        return hf_stage(model, spec, boundary_group=boundary_group)

    def attention_dims(self, model: nn.Module) -> tuple[int, int] | None:
        # num_hidden_layers / num_attention_heads are aliased to every family's own names.
        hf: Any = model.config
        layers = getattr(hf, "num_hidden_layers", None)
        heads = getattr(hf, "num_attention_heads", None)
        if layers is None or not heads:
            return None
        # Some families (Qwen3, Gemma) set head_dim apart from hidden_size / heads.
        head_dim = getattr(hf, "head_dim", None) or int(hf.hidden_size) // int(heads)
        return int(layers), int(heads) * int(head_dim)

    def state_record(self, model: nn.Module) -> dict[str, Any]:
        # What `boost export --format hf` writes as config.json, low-rank layout included.
        return {STATE_KEY: config_record(model)}
