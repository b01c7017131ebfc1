"""MultiLoraTransformersModel: Twinkle's remote model client, over twinkle.v1.TrainingService.

Method names and arguments are Twinkle's. Differences, all on the client side:
- Trajectories are encoded here with the template from set_template (default: a Template on
  the server's tokenizer); the server takes token ids only.
- The adapter's server-side name is `{adapter_name}-{8 hex}` so runs of the same script never
  collide; `adapter_name` arguments keep using your name.
- set_processor accepts 'InputProcessor' (the server pads and batches); add_metric,
  apply_patch and upload_to_hub raise UnsupportedFeatureError.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

import twinkle.template as template_module
from twinkle import get_logger
from twinkle.template import Template
from twinkle.utils import construct_class
from twinkle_client import _context
from twinkle_client._proto.twinkle.v1 import training_pb2 as pb
from twinkle_client._rpc import ProgressCallback
from twinkle_client.errors import UnsupportedFeatureError
from twinkle_client.manager import TwinkleClient
from twinkle_client.model._inputs import (
    advantages_list,
    as_rows,
    encode_rows,
    logprob_lists,
    model_output,
    split_rows,
)

logger = get_logger("twinkle_client")

# Keyword arguments Twinkle scripts pass that change nothing here.
_IGNORED_FORWARD = frozenset({"micro_batch_size", "temperature", "return_logits", "adapter_name"})
_PROCESSORS = frozenset({"InputProcessor"})


class SavedCheckpoint(str):
    """What save() returns: the twinkle:// path (a str), with .twinkle_path and .checkpoint_dir."""

    checkpoint_dir: str

    def __new__(cls, twinkle_path: str, checkpoint_dir: str = "") -> SavedCheckpoint:
        value = super().__new__(cls, twinkle_path)
        value.checkpoint_dir = checkpoint_dir
        return value

    @property
    def twinkle_path(self) -> str:
        return str(self)


class MultiLoraTransformersModel:
    """A LoRA adapter on the server's base model.

    Args:
        model_id: the base model (ms://Qwen/..., or the server's model name); used for the
            default template's tokenizer (fetched from the server unless it is a local path).
        client: the TwinkleClient to use (default: the one init_twinkle_client made).
        progress: show progress of long calls (default: the client's setting).
    """

    def __init__(self, model_id: str, *, client: TwinkleClient | None = None,
                 progress: bool | ProgressCallback | None = None, **kwargs: Any) -> None:
        self.model_id = model_id
        self.client = client or _context.current()
        self.progress = progress
        self.adapter_name: str | None = None
        self._server_names: dict[str, str] = {}
        self.run_ids: dict[str, str] = {}
        self._template: Template | None = None
        self._template_spec: tuple[Any, dict[str, Any]] | None = None
        self._warned: set[str] = set()

    # ---- plumbing ------------------------------------------------------------------------

    def _call(self, rpc: str, request: Any, **options: Any) -> Any:
        return self.client.call(getattr(self.client.training, rpc), request, name=rpc,
                                progress=self.progress, **options)

    def _name(self, adapter_name: str | None) -> str:
        name = adapter_name or self.adapter_name
        if name is None:
            raise ValueError("no adapter: call add_adapter_to_model(...) first")
        if name not in self._server_names:
            raise ValueError(f"unknown adapter '{name}' (added: {sorted(self._server_names)})")
        return self._server_names[name]

    @staticmethod
    def _options() -> pb.RequestOptions:
        return pb.RequestOptions(idempotency_key=uuid.uuid4().hex)

    def _ignore(self, kwargs: Mapping[str, Any], allowed: frozenset[str] = frozenset()) -> None:
        for key in kwargs:
            if key not in allowed and key not in self._warned:
                self._warned.add(key)
                logger.warning(f"MultiLoraTransformersModel: argument '{key}' is not supported and is ignored")

    def _template_instance(self) -> Template:
        if self._template is None:
            spec, kwargs = self._template_spec or (Template, {})
            kwargs = {"model_id": self.model_id, **kwargs}
            self._template = construct_class(spec, Template, template_module, **kwargs)
        return self._template

    # ---- adapters ------------------------------------------------------------------------

    def add_adapter_to_model(self, adapter_name: str, config: Any, **kwargs: Any) -> dict[str, Any]:
        """Add a LoRA adapter (config: a peft LoraConfig, a dict of its fields, or Twinkle's JSON
        string). kwargs: gradient_accumulation_steps, seed."""
        lora = lora_config_proto(config)
        if "seed" in kwargs:
            lora.seed = int(kwargs.pop("seed"))
        gas = int(kwargs.pop("gradient_accumulation_steps", 1) or 1)
        self._ignore(kwargs)
        server_name = f"{adapter_name}-{secrets.token_hex(4)}"
        # On the base model model_id names when the server serves several (else its default).
        reply = self._call("AddAdapter", pb.AddAdapterRequest(
            adapter_name=server_name, config=lora, gradient_accumulation_steps=gas,
            session_id=self.client.session_id or "", base_model=self.client.served_model(self.model_id)))
        self._server_names[adapter_name] = reply.adapter_name
        self.run_ids[adapter_name] = reply.run_id
        self.adapter_name = adapter_name
        return {"status": "ok", "adapter_name": reply.adapter_name, "run_id": reply.run_id,
                "num_parameters": reply.num_parameters}

    def remove_adapter(self, adapter_name: str | None = None) -> None:
        name = adapter_name or self.adapter_name
        self._call("RemoveAdapter", pb.AdapterRequest(adapter_name=self._name(name)))
        self._server_names.pop(name or "", None)
        if name == self.adapter_name:
            self.adapter_name = next(iter(self._server_names), None)

    # ---- configuration -------------------------------------------------------------------

    def set_template(self, template_cls: Any = "Template", **kwargs: Any) -> None:
        """The template used to encode Trajectory inputs (built on first use; model_id
        defaults to this model's)."""
        kwargs.pop("adapter_name", None)
        self._template_spec = (template_cls, kwargs)
        self._template = None

    def set_processor(self, processor_cls: Any, **kwargs: Any) -> None:
        """Only Twinkle's InputProcessor (padding options included) is accepted: the server
        pads and batches sequences itself."""
        name = processor_cls if isinstance(processor_cls, str) else getattr(processor_cls, "__name__", "")
        if name not in _PROCESSORS:
            raise UnsupportedFeatureError(f"set_processor: '{processor_cls}' is not supported (only InputProcessor)")

    def set_loss(self, loss_cls: str, **kwargs: Any) -> None:
        """A loss by Twinkle class name (CrossEntropyLoss, GRPOLoss, ...) with its arguments."""
        name = _name_of(loss_cls)
        numbers, strings = _split_config(kwargs, "set_loss")
        self._call("SetLoss", pb.SetLossRequest(adapter_name=self._name(kwargs.pop("adapter_name", None)),
                                                loss_cls=name, config=numbers, string_config=strings))

    def set_optimizer(self, optimizer_cls: str, **kwargs: Any) -> None:
        """AdamW | Adam | SGD with lr, weight_decay, betas, eps, momentum, ..."""
        adapter = kwargs.pop("adapter_name", None)
        if "betas" in kwargs:
            beta1, beta2 = kwargs.pop("betas")
            kwargs.update(beta1=beta1, beta2=beta2)
        numbers, strings = _split_config(kwargs, "set_optimizer")
        if strings:
            raise ValueError(f"set_optimizer: non-numeric arguments {sorted(strings)}")
        self._call("SetOptimizer", pb.SetOptimizerRequest(adapter_name=self._name(adapter),
                                                          optimizer_cls=_name_of(optimizer_cls), config=numbers))

    def set_lr_scheduler(self, scheduler_cls: str, **kwargs: Any) -> None:
        """LinearLR, CosineAnnealingLR, CosineWarmupScheduler, LinearWarmupScheduler, constant."""
        adapter = kwargs.pop("adapter_name", None)
        numbers, strings = _split_config(kwargs, "set_lr_scheduler")
        if strings:
            raise ValueError(f"set_lr_scheduler: non-numeric arguments {sorted(strings)}")
        self._call("SetLrScheduler", pb.SetLrSchedulerRequest(adapter_name=self._name(adapter),
                                                              scheduler_cls=_name_of(scheduler_cls), config=numbers))

    def add_metric(self, metric_cls: Any, is_training: bool | None = None, **kwargs: Any) -> None:
        raise UnsupportedFeatureError(f"add_metric('{_name_of(metric_cls)}'): the server reports its built-in "
                                      "metrics only (calculate_metric); compute others client-side")

    def apply_patch(self, patch_cls: Any, **kwargs: Any) -> None:
        raise UnsupportedFeatureError(f"apply_patch('{_name_of(patch_cls)}'): server-side patches are not supported")

    def upload_to_hub(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedFeatureError("upload_to_hub: the server does not upload to hubs; export_merged_model "
                                      "or the checkpoint files can be uploaded by you")

    # ---- forward / backward --------------------------------------------------------------

    def _forward(self, rpc: str, inputs: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        adapter = self._name(kwargs.pop("adapter_name", None))
        advantages, old, ref = kwargs.pop("advantages", None), kwargs.pop("old_logps", None), kwargs.pop("ref_logps", None)
        disable_lora = bool(kwargs.pop("disable_lora", False))
        self._ignore(kwargs, _IGNORED_FORWARD)
        rows = encode_rows(as_rows(inputs), self._template_instance)
        encoded = split_rows(rows)
        request = pb.ForwardRequest(
            adapter_name=adapter,
            inputs=[pb.InputFeature(input_ids=i, labels=l) for i, l in zip(encoded.input_ids, encoded.labels)],
            advantages=advantages_list(advantages, encoded),
            old_logps=[pb.FloatList(values=v) for v in logprob_lists(old, "old_logps", encoded)],
            ref_logps=[pb.FloatList(values=v) for v in logprob_lists(ref, "ref_logps", encoded)],
            disable_lora=disable_lora, options=self._options())
        return model_output(self._call(rpc, request).result, encoded)

    def forward(self, inputs: Any, **kwargs: Any) -> dict[str, Any]:
        """Forward with the adapter's loss, no gradient."""
        return self._forward("Forward", inputs, kwargs)

    def forward_only(self, inputs: Any, **kwargs: Any) -> dict[str, Any]:
        """Log-probs only (disable_lora=True: the base model's)."""
        return self._forward("ForwardOnly", inputs, kwargs)

    def forward_backward(self, inputs: Any, **kwargs: Any) -> dict[str, Any]:
        """Forward and backward with the adapter's loss (GRPO: advantages=, old_logps=)."""
        return self._forward("ForwardBackward", inputs, kwargs)

    def calculate_loss(self, **kwargs: Any) -> float:
        request = pb.AdapterRequest(adapter_name=self._name(kwargs.pop("adapter_name", None)), options=self._options())
        return float(self._call("CalculateLoss", request).value)

    def backward(self, **kwargs: Any) -> None:
        request = pb.AdapterRequest(adapter_name=self._name(kwargs.pop("adapter_name", None)), options=self._options())
        self._call("Backward", request)

    # ---- optimizer -----------------------------------------------------------------------

    def _control(self, rpc: str, kwargs: dict[str, Any]) -> Any:
        request = pb.AdapterRequest(adapter_name=self._name(kwargs.pop("adapter_name", None)), options=self._options())
        self._ignore(kwargs)
        return self._call(rpc, request)

    def clip_grad_norm(self, max_grad_norm: float = 1.0, norm_type: float = 2, **kwargs: Any) -> float | None:
        """The gradient norm before clipping (None while gradient accumulation skips)."""
        reply = self._call("ClipGradNorm", pb.ClipGradNormRequest(
            adapter_name=self._name(kwargs.pop("adapter_name", None)), max_grad_norm=max_grad_norm,
            norm_type=norm_type, options=self._options()))
        return None if reply.skipped else float(reply.value)

    def step(self, **kwargs: Any) -> None:
        self._control("Step", kwargs)

    def zero_grad(self, **kwargs: Any) -> None:
        self._control("ZeroGrad", kwargs)

    def lr_step(self, **kwargs: Any) -> None:
        self._control("LrStep", kwargs)

    def clip_grad_and_step(self, max_grad_norm: float = 1.0, norm_type: float = 2, **kwargs: Any) -> float | None:
        """clip_grad_norm, step, zero_grad, lr_step; returns the pre-clip norm (None if skipped)."""
        reply = self._call("ClipGradAndStep", pb.ClipGradNormRequest(
            adapter_name=self._name(kwargs.pop("adapter_name", None)), max_grad_norm=max_grad_norm,
            norm_type=norm_type, options=self._options()))
        return None if reply.skipped else float(reply.value)

    # ---- reporting -----------------------------------------------------------------------

    def calculate_metric(self, is_training: bool = True, **kwargs: Any) -> dict[str, str]:
        reply = self._call("CalculateMetric", pb.CalculateMetricRequest(
            adapter_name=self._name(kwargs.pop("adapter_name", None)), is_training=is_training))
        return dict(reply.result)

    def get_train_configs(self, **kwargs: Any) -> str:
        reply = self._call("GetTrainConfigs", pb.AdapterRequest(adapter_name=self._name(kwargs.pop("adapter_name", None))))
        return str(reply.result)

    def get_state_dict(self, **kwargs: Any) -> dict[str, np.ndarray]:
        reply = self._call("GetStateDict", pb.AdapterRequest(adapter_name=self._name(kwargs.pop("adapter_name", None))))
        return {t.name: np.asarray(t.values, dtype=np.float32).reshape(list(t.shape)) for t in reply.tensors}

    # ---- checkpoints ---------------------------------------------------------------------

    def save(self, name: str | None = None, save_optimizer: bool = False, is_sampler: bool = False,
             consumed_train_samples: int = 0, **kwargs: Any) -> SavedCheckpoint:
        """Save a checkpoint (name: empty = the time); returns its twinkle:// path. output_dir is
        ignored: the server keeps checkpoints in your data directory."""
        adapter = self._name(kwargs.pop("adapter_name", None))
        self._ignore(kwargs, frozenset({"output_dir"}))
        reply = self._call("Save", pb.SaveRequest(adapter_name=adapter, name=name or "", save_optimizer=save_optimizer,
                                                  is_sampler=is_sampler,
                                                  consumed_train_samples=int(consumed_train_samples or 0)))
        return SavedCheckpoint(reply.twinkle_path, reply.checkpoint_dir)

    def load(self, name: str, load_optimizer: bool = False, **kwargs: Any) -> None:
        """Weights (and optimizer state) from twinkle://<run>/weights/<name>, or a name of this run."""
        adapter = self._name(kwargs.pop("adapter_name", None))
        self._ignore(kwargs)
        self._call("Load", pb.LoadRequest(adapter_name=adapter, name=str(name), load_optimizer=load_optimizer))

    def resume_from_checkpoint(self, name: str, resume_only_model: bool = False, **kwargs: Any) -> dict[str, int]:
        """Weights, optimizer, schedule and counters; returns {cur_step, consumed_train_samples,
        gradient_accumulation_steps} for dataloader.resume_from_checkpoint."""
        adapter = self._name(kwargs.pop("adapter_name", None))
        self._ignore(kwargs)
        reply = self._call("ResumeFromCheckpoint", pb.LoadRequest(adapter_name=adapter, name=str(name),
                                                                  resume_only_model=resume_only_model))
        return {"cur_step": reply.cur_step, "consumed_train_samples": reply.consumed_train_samples,
                "gradient_accumulation_steps": reply.gradient_accumulation_steps}


def lora_config_proto(config: Any) -> pb.LoraConfig:
    """A twinkle.v1.LoraConfig from a peft LoraConfig, a dict, or Twinkle's JSON string."""
    if isinstance(config, str):
        import json

        config = json.loads(config)
    if isinstance(config, Mapping):
        values = {k: v for k, v in config.items() if k != "_TWINKLE_TYPE_"}
    elif hasattr(config, "to_dict"):
        values = config.to_dict()
    else:
        raise TypeError(f"config must be a peft LoraConfig or a dict, got {type(config).__name__}")
    if values.get("modules_to_save"):
        raise UnsupportedFeatureError("LoraConfig.modules_to_save is not supported (adapters train LoRA weights only)")
    if values.get("bias") not in (None, "none"):
        raise UnsupportedFeatureError(f"LoraConfig.bias='{values['bias']}' is not supported (only 'none')")
    targets = values.get("target_modules")
    if targets is None or targets == "all-linear":
        target_list: list[str] = []
    elif isinstance(targets, str):
        raise UnsupportedFeatureError(f"target_modules='{targets}': give 'all-linear' or a list of module names")
    else:
        target_list = sorted(str(t) for t in targets)
    return pb.LoraConfig(r=int(values.get("r") or 8), lora_alpha=float(values.get("lora_alpha") or 32),
                         lora_dropout=float(values.get("lora_dropout") or 0.0), target_modules=target_list,
                         use_rslora=bool(values.get("use_rslora", False)))


def _name_of(spec: Any) -> str:
    return spec if isinstance(spec, str) else getattr(spec, "__name__", type(spec).__name__)


def _split_config(kwargs: Mapping[str, Any], where: str) -> tuple[dict[str, float], dict[str, str]]:
    numbers: dict[str, float] = {}
    strings: dict[str, str] = {}
    for key, value in kwargs.items():
        if key == "adapter_name" or value is None:
            continue
        if isinstance(value, bool):
            numbers[key] = 1.0 if value else 0.0
        elif isinstance(value, (int, float, np.integer, np.floating)):
            numbers[key] = float(value)
        elif isinstance(value, str):
            strings[key] = value
        else:
            raise TypeError(f"{where}: argument '{key}' must be a number, bool or string, got {type(value).__name__}")
    return numbers, strings
