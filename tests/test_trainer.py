"""``autosp.integrations.transformers``: the Hugging Face Trainer and TRL's SFTTrainer on 2 gloo
ranks against the same trainer in one process (tiny Llama, fp32, dropout 0)."""

from __future__ import annotations

import pytest
import torch
import trainer_cases

pytest.importorskip("trl")


def _assert_same_losses(got: dict, want: dict, rtol: float, steps) -> None:
    for step in steps:
        assert abs(got[step] - want[step]) <= rtol * abs(want[step]), (step, got[step], want[step])


@pytest.mark.slow
def test_sequence_parallel_trainer_logs_the_single_process_losses_and_resumes_alike(pools, tmp_path):
    """12 steps (gradient accumulation 2, clipping to 1.0, cosine, AdamW, a new length every
    batch): each logged loss within 1e-4 of the one-process Trainer's, the evaluation loss within
    1e-5, and a run resumed from step 6's checkpoint logs the same steps 7-12. Would catch: the
    data sharded over every rank (sp ranks reading different batches: the input check fails),
    the loss scaled by the world size twice, DDP reducing autosp's gradients again, the last
    evaluation batch cut by accelerate's world-wide remainder, evaluation unsharded, predict()
    without its logits (dropped as they are for a loss)."""
    one = pools(1).run(trainer_cases.train, "trainer", 1, str(tmp_path / "one"), 12)[0]
    full, _ = pools(2).run(trainer_cases.train, "trainer", 2, str(tmp_path / "sp"), 12, 6)
    assert sorted(full["losses"]) == list(range(1, 13))
    _assert_same_losses(full["losses"], one["losses"], 1e-4, range(1, 13))
    assert abs(full["eval_loss"] - one["eval_loss"]) <= 1e-5 * one["eval_loss"]
    # the work is split: ring attention (HF's mask split by query rows) in training and in the
    # forward-only evaluation
    assert full["train_plan"]["kinds"] == ["all_reduce", "ring"], full["train_plan"]
    assert full["eval_plan"]["kinds"] == ["all_reduce", "ring"], full["eval_plan"]
    assert any(n.startswith("forward only") for n in full["eval_plan"]["notes"])
    # predict() returns the logits (the one place they are gathered), one device's
    assert full["logits"].shape == one["logits"].shape
    torch.testing.assert_close(full["logits"], one["logits"], rtol=1e-5, atol=1e-5)

    resumed, _ = pools(2).run(
        trainer_cases.train, "trainer", 2, str(tmp_path / "sp"), 12, 0, str(tmp_path / "sp" / "checkpoint-6")
    )
    # steps 1-6 are the checkpoint's log; 7-12 ran again from its weights, optimizer, schedule and data position
    assert sorted(resumed["losses"]) == list(range(1, 13))
    _assert_same_losses(resumed["losses"], full["losses"], 1e-4, range(7, 13))


@pytest.mark.slow
def test_a_compute_loss_of_its_own_calling_the_model_positionally_matches_one_process(pools, tmp_path):
    """A user's ``compute_loss``: ``model(input_ids, attention_mask)`` positionally, no labels, the
    loss from the logits with the logits shifted. 5 logged losses within 1e-4 of one process's.
    The logits then leave the sharded step whole (an all-gather the plan notes as returned):
    exact, not split; pinned. Would catch: positional arguments unnamed (a TypeError), the logits
    dropped as for a loss computed inside the model."""
    one = pools(1).run(trainer_cases.train, "custom_loss", 1, str(tmp_path / "one"), 5)[0]
    sp, _ = pools(2).run(trainer_cases.train, "custom_loss", 2, str(tmp_path / "sp"), 5)
    _assert_same_losses(sp["losses"], one["losses"], 1e-4, range(1, 6))
    assert any(len(shape) == 3 and to == "output" for shape, to in sp["train_plan"]["gathers"])
    assert any("the step returns it" in n for n in sp["train_plan"]["notes"])


@pytest.mark.slow
@pytest.mark.parametrize("packing", [True], ids=["packed"])
def test_sequence_parallel_sft_trainer_logs_the_single_process_losses(pools, tmp_path, packing):
    """TRL's SFTTrainer (completion-only loss through its fused LM head's outputs, computed in the
    sharded step) with packing: padding-free rows of whole documents, position_ids restarting.
    Each of 10 logged losses within 1e-4 of one process's, the evaluation loss within 1e-5.
    SFTConfig's default gradient_checkpointing=True runs as autosp's checkpoint="full" (the one
    process: as torch.utils.checkpoint per layer). Would catch: documents attending across their
    bounds, the varlen bounds recompiling each batch (timeout), TRL's token-count metric gathered
    over the sp ranks, torch.utils.checkpoint left on the model (inside it, transformers'
    hub-kernel wrappers break the graph) or the request dropped."""
    one = pools(1).run(trainer_cases.train, "sft", 1, str(tmp_path / "one"), 10, 0, None, packing)[0]
    sp, _ = pools(2).run(trainer_cases.train, "sft", 2, str(tmp_path / "sp"), 10, 0, None, packing)
    _assert_same_losses(sp["losses"], one["losses"], 1e-4, range(1, 11))
    assert abs(sp["eval_loss"] - one["eval_loss"]) <= 1e-5 * one["eval_loss"]
    plan = sp["train_plan"]
    # the packed document mask is built by query rows: ring attention (docs/attention.md)
    assert "ring" in plan["kinds"] and set(plan["kinds"]) <= {"ring", "all_reduce", "halo", "all_gather"}
    # gathered: only what the step returns to TRL, per token (log-probabilities, entropy, top-1
    # hits, one (1, tokens) row each: 1/hidden of an activation), never an activation
    assert 1 <= len(plan["gathers"]) <= 4 and all(
        len(s) == 2 and s[0] == 1 and c == "output" for s, c in plan["gathers"]
    )
    assert any("the step returns it" in n for n in plan["notes"])
    assert plan["checkpoint"] == ("full", "full") and not plan["hf_checkpointing"], plan["checkpoint"]


@pytest.mark.slow
def test_sequence_parallel_trainer_under_bf16_is_as_accurate_as_one_process(pools, tmp_path):
    """``bf16=True`` (TRL's SFTConfig default): the sharded step runs the model under the
    Trainer's bf16 autocast, as accelerate's wrapper runs it in one process. bf16 rounds per op
    and the shards' matmuls are other shapes, so the runs agree to bf16's resolution, not to fp32's:
    each of 5 logged losses and the evaluation loss within 2^-8 relative of the one-process bf16
    run's (measured: 3.3e-5 at worst). Would catch:
    autocast dropped (ring attention's K/V then cross in fp32, and the losses are fp32's)."""
    one = pools(1).run(trainer_cases.train, "trainer", 1, str(tmp_path / "one"), 5, 0, None, False, 2, 4, True)[0]
    sp, _ = pools(2).run(trainer_cases.train, "trainer", 2, str(tmp_path / "sp"), 5, 0, None, False, 2, 4, True)
    _assert_same_losses(sp["losses"], one["losses"], 2**-8, range(1, 6))
    assert abs(sp["eval_loss"] - one["eval_loss"]) <= 2**-8 * one["eval_loss"]
    assert sp["train_plan"]["dtypes"]["ring"] == ["bfloat16"], sp["train_plan"]["dtypes"]


def test_sequence_parallel_trainer_refuses_what_it_cannot_run_exactly(tmp_path):
    """Errors, not a silently different run: fp16 (loss scaling) and torch_compile / FSDP / DeepSpeed
    (accelerate's wrappers, which a model marked prepared skips), an sp that does not divide the
    world, a class that is not a Trainer."""
    import hf_models
    import transformers as T

    from autosp.integrations.transformers import SequenceParallelTrainer, sequence_parallel

    def make(sp, **args):
        args = T.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **args)
        model = hf_models.build("llama", "sdpa")
        return SequenceParallelTrainer(model=model, args=args, train_dataset=trainer_cases.samples(4, 0), sp=sp)

    with pytest.raises(ValueError, match=r"fp16=True.*bf16=True"):
        make(1, fp16=True)
    with pytest.raises(ValueError, match=r"fsdp=, deepspeed= or torch_compile=.*docs/fsdp.md"):
        make(1, torch_compile=True)
    with pytest.raises(ValueError, match=r"sp=3\) on 1 processes: sp must divide the world size"):
        make(3)
    with pytest.raises(TypeError, match="pass transformers.Trainer or a subclass"):
        sequence_parallel(dict)


def test_every_way_to_ask_for_activation_checkpointing_is_autosps_full_rung(tmp_path):
    """The Trainer's gradient_checkpointing=True, its newer name activation_checkpointing=True, and
    a model on which gradient_checkpointing_enable() ran before the Trainer: each is autosp's
    checkpoint="full", turned off on the model and in the arguments (the Trainer would turn it on
    again in train()); a checkpoint= given wins; none asked: autosp's default. Would catch: a form
    of the request dropped (the model's torch.utils.checkpoint then breaks the graph)."""
    import hf_models
    import transformers as T

    from autosp.integrations.transformers import SequenceParallelTrainer

    def make(model_on=False, sp_args=None, **args):
        args = T.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **args)
        model = hf_models.build("llama", "sdpa")
        if model_on:
            model.gradient_checkpointing_enable()
        kw = dict(model=model, args=args, train_dataset=trainer_cases.samples(4, 0), sp=1, **(sp_args or {}))
        trainer = SequenceParallelTrainer(**kw)
        left = any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
        return trainer._sp_options["checkpoint"], bool(trainer.args.activation_checkpointing), left

    assert make(gradient_checkpointing=True) == ("full", False, False)
    assert make(activation_checkpointing=True) == ("full", False, False)
    assert make(model_on=True) == ("full", False, False)
    assert make(sp_args=dict(checkpoint="none"), gradient_checkpointing=True) == ("none", False, False)
    assert make() == ("auto", False, False)


@pytest.mark.slow
def test_sequence_parallel_trainer_on_sp_2_by_dp_2_matches_one_process(pools, tmp_path):
    """4 ranks as 2 dp replicas of an sp group of 2 (2 micro-batches of 2 per replica) against
    one process taking the same 8 samples a step as 4 micro-batches: each of 6 logged losses
    within 1e-4, the evaluation loss (8 samples: no padded batch) within 1e-5. Would catch: the
    data sharded over 4 ranks (or not over dp at all), gradients summed instead of averaged
    over the replicas, the token count or the loss scale off by the replica count, metrics
    gathered over every rank."""
    one = pools(1).run(trainer_cases.train, "trainer", 1, str(tmp_path / "one"), 6, 0, None, False, 4, 8)[0]
    runs = pools(4).run(trainer_cases.train, "trainer", 2, str(tmp_path / "sp"), 6, 0, None, False, 2, 8)
    for run in runs:
        _assert_same_losses(run["losses"], one["losses"], 1e-4, range(1, 7))
        assert abs(run["eval_loss"] - one["eval_loss"]) <= 1e-5 * one["eval_loss"]
        assert "ring" in run["train_plan"]["kinds"]
