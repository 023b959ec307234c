"""Hugging Face ``Trainer`` (and the trainers built on it: TRL's ``SFTTrainer``, ...) run
sequence-parallel: ``SequenceParallelTrainer(sp=2, ...)``, or ``sequence_parallel(TrainerClass)``.

Under torchrun with W processes the ranks form ``autosp.mesh(sp=sp, dp=W // sp)``. What changes
against the Trainer, and why each gives the single-process step:
- **Data over the dp replicas only.** The Trainer's data loaders are sharded over dp (accelerate's
  batch sampler told dp replicas, not W processes), so the ranks of an sp group read the same
  batches; metrics (the evaluation loss, TRL's token counts) are gathered over dp alone.
- **The model's forward through** ``autosp.shard``. ``compute_loss`` (the Trainer's, TRL's or
  yours) calls the model as usual; the call runs as one sharded step on the sp group, its loss
  the single-device loss and every ``.grad`` after ``backward`` the single-device gradient (the
  mean over the dp replicas, as DDP's). Where the model computed the loss from ``labels``, its
  logits are not returned (they would be gathered whole on every rank); without labels they are.
- **No DDP wrapper.** autosp reduces the gradients itself, so accelerate is told the model is
  prepared. The Trainer's loss scaling stays as it is: it counts the loss's tokens over all W
  processes (each sp group's sp times) and multiplies the loss by W, which together give the
  mean over dp of each replica's share, as DDP's average over W gives.

- **bf16=True**: accelerate wraps a model's forward in autocast when it prepares it; the model
  marked prepared, the sharded step runs the forward under the same autocast and returns its
  outputs as fp32, as accelerate's wrapper does. ``fp16=True`` (loss scaling) is an error.

- **Activation checkpointing** is autosp's: the Trainer's ``gradient_checkpointing=True`` (TRL's
  SFTConfig default; or ``activation_checkpointing=True``, or a model on which it is enabled) is
  ``checkpoint="full"`` (whole layers recomputed, as the Trainer's per-layer
  ``torch.utils.checkpoint``) unless ``checkpoint=`` is given, and is turned off on the model.
  Its ``gradient_checkpointing_kwargs`` (``use_reentrant``, ``every_n_layers``, ``offload``) are not read.

Everything else is the Trainer's: gradient accumulation, clipping to the global norm (every rank
holds the whole gradient), schedulers, checkpoints and resuming.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch
import torch.distributed as dist
import transformers

from .._context import Options
from ..annotations import mesh as _mesh
from ..annotations import shard as _shard

__all__ = ["SequenceParallelTrainer", "sequence_parallel"]

# outputs not returned where the model computed the loss: activation-sized, gathered whole
_LARGE_OUTPUTS = ("logits", "hidden_states", "attentions", "past_key_values")
_FLASH_VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class _Outputs(dict):
    """A model's outputs as ``ModelOutput`` reads: by key, by attribute (TRL), by position."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, key):
        if isinstance(key, int):
            return list(self.values())[key]
        if key in _LARGE_OUTPUTS and key not in self:
            raise KeyError(
                f"autosp: the model's {key!r} were not returned from the sharded step: the model computed its loss "
                f"from labels, and the {key} would be gathered whole on every rank; compute the loss inside the "
                f"model, or call it without labels to have the {key} returned (gathered)"
            )
        return super().__getitem__(key)

    def to_tuple(self) -> tuple:
        return tuple(self.values())


def _fused_settings(model) -> dict[str, Any]:
    """The settings TRL's ``add_fused_lm_head`` closed its forward over (temperature, outputs), or
    {} where the forward is not a closure that names them."""
    fn = getattr(model.forward, "__func__", model.forward)
    names, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    return dict(zip(names.co_freevars, (c.cell_contents for c in cells))) if names is not None else {}


def _fused_lm_head(
    model, settings: dict, labels=None, shift_labels=None, num_items_in_batch=None, **inputs
) -> dict[str, torch.Tensor]:
    """What TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``, at temperature 1; the
    fields of its ``FusedCausalLMOutput``) returns, from the model's own logits in plain torch
    ops: its chunked kernel writes tiles with ``out=``, which Dynamo cannot trace, and inside the
    sharded step the logits are each rank's own rows, never whole. ``settings``: ``_fused_settings``'
    (read before tracing: Dynamo cannot read a closure's cells)."""
    if settings.get("temperature", 1.0) != 1.0:
        raise NotImplementedError(
            f"autosp: TRL's fused LM head at temperature {settings['temperature']} (GRPO, RLOO, ...) is not "
            "reproduced inside the sharded step; only SFTTrainer's (temperature 1) is"
        )
    out = model(**inputs, fused_lm_head=False)
    logits = out.logits.float()
    if shift_labels is None:
        logits, shift_labels = logits[:, :-1], labels[:, 1:]
    mask = shift_labels != -100
    targets = shift_labels.clamp(min=0)
    log_z = torch.logsumexp(logits, dim=-1)
    target = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    log_probs = torch.where(mask, target - log_z, 0.0)
    probs = torch.softmax(logits, dim=-1)
    entropy = torch.where(mask, log_z - (probs * logits).sum(-1), 0.0)
    is_top1 = mask & (logits.argmax(-1) == targets)
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -log_probs.sum() / count
    fields = dict(log_probs=log_probs, entropy=entropy, is_top1=is_top1, label_mask=mask)
    wanted = settings.get("outputs", ())
    if "mean_logits" in wanted:
        fields["mean_logits"] = torch.where(mask, logits.detach().mean(-1), 0.0)
    if "log_sum_sq_probs" in wanted:
        fields["log_sum_sq_probs"] = torch.where(
            mask, torch.logsumexp(2 * (logits.detach() - log_z[..., None].detach()), -1), 0.0
        )
    if out.get("aux_loss") is not None:
        loss = loss + model.config.get_text_config().router_aux_loss_coef * out.aux_loss
        fields["aux_loss"] = out.aux_loss
    return dict(loss=loss, **fields)


def _forward(model, keep_logits: bool, fused: dict, amp: dict | None, **inputs) -> dict[str, torch.Tensor]:
    """The model's outputs; the activation-sized ones only with ``keep_logits`` or no loss. With
    ``amp`` (``torch.autocast``'s arguments) the call runs under autocast and its low-precision
    outputs come back as fp32, as accelerate wraps a model's forward for ``bf16=True``."""
    if amp is None:
        return _outputs(model, keep_logits, fused, **inputs)
    with torch.autocast(**amp):
        out = _outputs(model, keep_logits, fused, **inputs)
    low = (torch.bfloat16, torch.float16)
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.float() if t.dtype in low else t, out)


def _outputs(model, keep_logits: bool, fused: dict, **inputs):
    if inputs.pop("fused_lm_head", False):
        return _fused_lm_head(model, fused, **inputs)
    out = model(**inputs)
    if not isinstance(out, dict):  # return_dict=False: a tuple, returned whole (its logits gathered)
        return out
    keep = {k: v for k, v in out.items() if v is not None}
    if keep.get("loss") is not None and not keep_logits:
        keep = {k: v for k, v in keep.items() if k not in _LARGE_OUTPUTS}
    return keep


def _named(forward, args: tuple, kwargs: dict) -> dict:
    """``forward(*args, **kwargs)``'s arguments by name (those of its ``**kwargs`` among them)."""
    sig = inspect.signature(forward)
    out = {}
    for name, value in sig.bind_partial(*args, **kwargs).arguments.items():
        out.update(value if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD else {name: value})
    return out


class _ShardedModel:
    """What ``compute_loss`` calls in place of the model: its forward as one ``autosp.shard`` step
    on the sp group; every attribute read goes to the model."""

    def __init__(self, model, step):
        self._model, self._step = model, step

    def __call__(self, *args, **inputs):
        if args:  # model(input_ids, attention_mask=...): named as the model's forward names them
            inputs = _named(self._model.forward, args, inputs)
        if "flash" not in str(getattr(self._model.config, "_attn_implementation", "")):
            # padding-free batches (TRL's packing) carry the documents' bounds for flash attention's
            # varlen kernels; SDPA and eager attention read the documents from position_ids and
            # ignore these, whose sizes (the number of documents) would recompile at each batch
            inputs = {k: v for k, v in inputs.items() if k not in _FLASH_VARLEN}
        out = self._step(**inputs)
        return _Outputs(out) if isinstance(out, dict) else out  # return_dict=False: the model's tuple

    def __getattr__(self, name):
        return getattr(self._model, name)


def _gather_over(group, size: int, data):
    """``data`` (tensors, nested in lists / dicts) from every rank of ``group``, concatenated on dim 0."""
    if size == 1:
        return data
    if isinstance(data, torch.Tensor):
        parts = [torch.empty_like(data) for _ in range(size)]
        dist.all_gather(parts, data.contiguous(), group=group)
        return torch.cat([p if p.ndim else p[None] for p in parts])
    if isinstance(data, (list, tuple)):
        return type(data)(_gather_over(group, size, x) for x in data)
    if isinstance(data, dict):
        return type(data)({k: _gather_over(group, size, v) for k, v in data.items()})
    out = [None] * size
    dist.all_gather_object(out, data, group=group)
    return [x for part in out for x in (part if isinstance(part, list) else [part])]


def _autocast(accelerator) -> dict | None:
    """``torch.autocast``'s arguments for the model's forward where accelerate's ``prepare`` would
    have wrapped it in autocast (``bf16=True``: the model marked prepared skips that wrapper, so
    the sharded step applies it inside), else None."""
    if not accelerator.native_amp:
        return None
    handler = accelerator.autocast_handler
    kwargs = handler.to_kwargs() if handler is not None else {}
    return dict(device_type=accelerator.device.type, dtype=torch.bfloat16, **kwargs)


def _take_checkpointing(args, model) -> bool:
    """Whether the Trainer was asked for activation checkpointing (``gradient_checkpointing=True``,
    TRL's SFTConfig default, or ``activation_checkpointing=True``) or the model runs it already;
    turned off in both, for autosp to recompute on the joint graph instead: a
    ``torch.utils.checkpoint`` in the captured step is a higher-order op, inside which Python state
    the model sets (transformers' hub-kernel wrappers set a context variable in every attention
    forward) breaks the graph."""
    asked = False
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if getattr(args, name, None):
            asked = True
            setattr(args, name, False)
    if model is not None and any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        asked = True
        off = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        off()
    return asked


class _SequenceParallel:
    """The mixin ``sequence_parallel`` puts in front of a Trainer class."""

    def __init__(self, *args, sp: int | None = None, seq: Any = True, **kwargs):
        names = Options.keys()
        given = {k: kwargs.pop(k) for k in names if k in kwargs}
        Options.of(**given)  # an unknown or bad option fails before the Trainer is built
        super().__init__(*args, **kwargs)
        if _take_checkpointing(self.args, self.model):
            given.setdefault("checkpoint", "full")
        self._sp_options = dataclasses.asdict(Options.of(**given))
        # a model marked prepared (below) skips accelerate's wrappers: refuse what they would have done
        if self.args.fp16:
            raise ValueError(
                "autosp: SequenceParallelTrainer with fp16=True: fp16's loss scaling is not composed with autosp "
                "yet; train with bf16=True, or load the model in the dtype to train in (torch_dtype=torch.float16)"
            )
        self._sp_amp = _autocast(self.accelerator)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled or self.args.torch_compile:
            raise ValueError(
                "autosp: SequenceParallelTrainer with the Trainer's fsdp=, deepspeed= or torch_compile=: autosp "
                "compiles the step and reduces the gradients itself, and does not compose with these yet; drop "
                "them (for FSDP2 with autosp, see docs/fsdp.md: fully_shard in a training loop)"
            )
        world = dist.get_world_size() if dist.is_initialized() else 1
        sp = world if sp is None else sp
        if sp < 1 or world % sp:
            raise ValueError(
                f"autosp: SequenceParallelTrainer(sp={sp}) on {world} processes: sp must divide the world size "
                "(the ranks form sp x dp = world)"
            )
        self._sp_scope = _mesh(sp=sp, dp=world // sp)
        with self._sp_scope as m:
            self.sp_mesh = m
        self._sp_seq = seq
        self._sp_steps: dict[tuple[int, bool], Any] = {}
        self._sp_predicting = False
        # accelerate wraps a model once: marked prepared, it is not put in DDP (autosp reduces
        # the gradients over the mesh itself)
        self.model._is_accelerate_prepared = True
        if self.sp_mesh.dp_size < world:
            # the Trainer's evaluation loop gathers through gather_function, reset to the
            # accelerator's gather_for_metrics after each evaluation; TRL's metrics gather through the latter
            self.accelerator.gather_for_metrics = self._gather_for_metrics
            self.gather_function = functools.partial(
                self._gather_for_metrics, use_gather_object=self.args.eval_use_gather_object
            )

    # the model call: one sharded step per model, and per whether its logits are returned (each
    # compiles its own graph)
    def _sharded(self, model, keep_logits: bool):
        model = self.accelerator.unwrap_model(model)
        key = (id(model), keep_logits)
        if key not in self._sp_steps:
            step = functools.partial(_forward, model, keep_logits, _fused_settings(model), self._sp_amp)
            self._sp_steps[key] = _shard(step, seq=self._sp_seq, **self._sp_options)
        return _ShardedModel(model, self._sp_steps[key])

    def compute_loss(self, model, inputs, return_outputs=False, *args, **kwargs):
        # the logits come back where predictions need them (predict, compute_metrics), not for a loss
        keep = return_outputs and self._sp_predicting
        with self._sp_scope:
            return super().compute_loss(self._sharded(model, keep), inputs, return_outputs, *args, **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, *args, **kwargs):
        self._sp_predicting = not prediction_loss_only
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, *args, **kwargs)
        finally:
            self._sp_predicting = False

    # the data: sharded over the dp replicas, not over every process
    def _get_dataloader(self, *args, **kwargs):
        loader = super()._get_dataloader(*args, **kwargs)
        sampler = getattr(loader, "batch_sampler", None)
        if hasattr(sampler, "num_processes"):  # accelerate's BatchSamplerShard
            sampler.num_processes, sampler.process_index = self.sp_mesh.dp_size, self.sp_mesh.dp_rank
            if self.sp_mesh.dp_size == 1:  # as accelerate leaves one process's batches: the last one short
                sampler.even_batches = False
        elif self.sp_mesh.dp_size < self.accelerator.num_processes:
            raise NotImplementedError(
                f"autosp: SequenceParallelTrainer: the data loader ({type(loader).__name__}) is not sharded by "
                "accelerate's batch sampler (an IterableDataset?), so the ranks of an sp group would read different "
                "batches; use a map-style dataset"
            )
        return loader

    def get_total_train_batch_size(self, args) -> int:
        return self._train_batch_size * args.gradient_accumulation_steps * self.sp_mesh.dp_size

    def _gather_for_metrics(self, data, use_gather_object: bool = False):
        """accelerate's ``gather_for_metrics`` over the dp replicas (the ranks of an sp group hold
        the same batch): the last batch cut to the dataset's remainder, as accelerate cuts it."""
        data = _gather_over(self.sp_mesh.dp_group, self.sp_mesh.dp_size, data)
        state = self.accelerator.gradient_state
        if not (state.end_of_dataloader and state.remainder > 0):
            return data

        def cut(x):
            return x[: state.remainder] if not isinstance(x, torch.Tensor) or x.ndim else x

        if isinstance(data, (list, tuple)) and not use_gather_object:
            return type(data)(cut(x) for x in data)
        if isinstance(data, dict):
            return type(data)({k: cut(v) for k, v in data.items()})
        return cut(data)


@functools.cache
def sequence_parallel(trainer_class: type) -> type:
    """``trainer_class`` (``transformers.Trainer`` or a subclass: ``trl.SFTTrainer``, ...) run
    sequence-parallel; the class takes ``sp=`` (default: the world size; the ranks form
    ``sp x dp``), ``seq=`` (as ``autosp.shard``'s) and ``autosp.shard``'s options
    (``checkpoint=``, ``attention=``, ``compiler=``, ...) besides its own arguments, e.g.
    ``sequence_parallel(trl.SFTTrainer)(model=model, args=args, train_dataset=data, sp=2)``."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(f"autosp: sequence_parallel({trainer_class!r}): pass transformers.Trainer or a subclass")
    return type(f"SequenceParallel{trainer_class.__name__}", (_SequenceParallel, trainer_class), {})


SequenceParallelTrainer = sequence_parallel(transformers.Trainer)
SequenceParallelTrainer.__doc__ = """``transformers.Trainer`` run sequence-parallel: ``sp=`` (default:
the world size), ``seq=`` and ``autosp.shard``'s options besides the Trainer's arguments."""
