"""Hugging Face Trainer and TRL runs, one device's and sequence-parallel, for
``tests/test_trainer.py``: importable by the pool's workers (gloo ranks) like ``cases``."""

from __future__ import annotations

import functools
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 128


def samples(n: int, seed: int) -> list[dict]:
    """Token sequences of 20 to 69 tokens, the first third of each a prompt (labels -100)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(20, 70, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        out.append(dict(input_ids=ids, completion_mask=[int(i >= length // 3) for i in range(length)]))
    return out


def collate(batch: list[dict]) -> dict[str, torch.Tensor]:
    """Right padding to the batch's longest sample: a new length every batch."""
    length = max(len(b["input_ids"]) for b in batch)
    ids = torch.zeros(len(batch), length, dtype=torch.long)
    labels = torch.full((len(batch), length), -100)
    mask = torch.zeros(len(batch), length, dtype=torch.long)
    for i, b in enumerate(batch):
        n = len(b["input_ids"])
        ids[i, :n] = torch.tensor(b["input_ids"])
        labels[i, :n] = torch.where(torch.tensor(b["completion_mask"]) == 1, ids[i, :n], -100)
        mask[i, :n] = 1
    return dict(input_ids=ids, labels=labels, attention_mask=mask)


def _tokenizer():
    import tokenizers
    import transformers as T

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    model = tokenizers.models.WordLevel(vocab, unk_token="<pad>")
    return T.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(model), pad_token="<pad>", eos_token="t1")


@functools.cache
def logits_loss_trainer() -> type:
    """A Trainer whose ``compute_loss`` calls the model positionally, without labels, and takes the
    loss from the logits, shifting the logits rather than the labels (as users write it)."""
    import transformers as T

    class LogitsLossTrainer(T.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(inputs["input_ids"], inputs["attention_mask"])
            logits, labels = out.logits[:, :-1], inputs["labels"][:, 1:]
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            return (loss, out) if return_outputs else loss

    return LogitsLossTrainer


def train(
    kind: str,
    sp: int,
    out: str,
    steps: int = 20,
    save_steps: int = 0,
    resume: str | None = None,
    packing: bool = False,
    accumulate: int = 2,
    eval_samples: int = 10,
    bf16: bool = False,
) -> dict:
    """``kind``: "trainer" (``transformers.Trainer``, the model's own loss from ``labels``) or "sft"
    (TRL's ``SFTTrainer``, its completion-only loss); ``sp`` 1: the class itself in one process,
    else ``sequence_parallel`` of it on every rank (sp x dp = the world). ``steps`` steps of
    ``accumulate`` micro-batches of 2 per dp replica, clipping to 1.0, cosine schedule, AdamW,
    fp32 (``bf16``: under the Trainer's bf16 autocast); then an evaluation (batches of 4,
    ``eval_samples``). Returns the logged losses by step, the evaluation loss and (sp > 1) the
    sharded step's collectives."""
    import datasets
    import hf_models
    import transformers as T
    import trl

    model = hf_models.build("llama", "sdpa")
    common = dict(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=accumulate,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        ddp_backend="gloo" if sp > 1 else None,
        bf16=bf16,
        disable_tqdm=True,
    )
    train_rows, eval_rows = samples(96, 0), samples(eval_samples, 1)
    if kind in ("trainer", "custom_loss"):
        args = T.TrainingArguments(**common, remove_unused_columns=False)
        kw = dict(train_dataset=train_rows, eval_dataset=eval_rows, data_collator=collate)
        cls = T.Trainer if kind == "trainer" else logits_loss_trainer()
    else:
        args = trl.SFTConfig(**common, packing=packing, max_length=256, completion_only_loss=True)
        kw = dict(
            train_dataset=datasets.Dataset.from_list(train_rows),
            eval_dataset=datasets.Dataset.from_list(eval_rows),
            processing_class=_tokenizer(),
        )
        cls = trl.SFTTrainer
    if sp > 1:
        from autosp.integrations.transformers import sequence_parallel

        trainer = sequence_parallel(cls)(model=model, args=args, sp=sp, compiler="aot_eager", dynamic=True, **kw)
    else:
        trainer = cls(model=model, args=args, **kw)
    trainer.train(resume_from_checkpoint=resume)
    result = dict(losses={h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h})
    result["train_plan"] = _plan(trainer) if sp > 1 else None
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    result["eval_plan"] = _plan(trainer) if sp > 1 else None
    if kind == "trainer":  # predictions: the logits, returned whole
        result["logits"] = torch.as_tensor(trainer.predict(eval_rows[:4]).predictions)
    return result


def _plan(trainer) -> dict:
    """The collectives (their kinds, and dtypes by kind) and notes of the plan the sharded model
    call (the one without logits) ran last."""
    step = trainer._sp_steps[(id(trainer.model), False)]
    kinds = sorted({c.kind for c in step.plan.collectives})
    return dict(
        kinds=kinds,
        notes=list(step.plan.notes),
        gathers=[(c.shape, c.consumer) for c in step.plan.collectives if c.kind == "all_gather"],
        dtypes={k: sorted({c.dtype for c in step.plan.collectives if c.kind == k}) for k in kinds},
        checkpoint=None if (c := step.plan.checkpoint) is None else (c.policy, c.chosen),  # None: no backward
        hf_checkpointing=any(getattr(m, "gradient_checkpointing", False) is True for m in trainer.model.modules()),
    )
