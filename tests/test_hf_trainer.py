"""TrainStreamTrainer against the stock transformers.Trainer, and wrap_hf, on tiny models.

The stock Trainer over the same model, data and arguments is the reference: the same losses
(within float tolerance: the engine's host AdamW and the chunked loss round differently from
torch's fused AdamW and the full logits), the same logged grad_norm, the same learning rates.
The runs are shared by the tests of one module (each Trainer run costs seconds on 2 cores).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import trainstream  # noqa: E402
import trainstream.loss  # noqa: E402
from trainstream.integrations.huggingface import TrainStreamTrainer, wrap_hf  # noqa: E402
from trainstream.integrations.huggingface.wrap import decoder_layers, rng_preserved  # noqa: E402

VOCAB = 128
STEPS = 6
# 22 rows in batches of 2, accumulated 2 at a time: one epoch of 6 steps whose last window
# holds a single micro-batch (the Trainer steps there; num_items_in_batch counts only it).
ROWS = 22
MICRO_BATCHES = ROWS // 2


def tiny_causal_lm(kind: str = "llama", seed: int = 0):
    """hidden 64, 2 layers, vocab 128, initialized by transformers from `seed`."""
    torch.manual_seed(seed)
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    config = transformers.LlamaConfig(**common) if kind == "llama" else transformers.Qwen2Config(**common)
    return transformers.AutoModelForCausalLM.from_config(config)


class RandomTokens(torch.utils.data.Dataset):
    """Token rows with a padded tail of random length (labels -100 there), so the Trainer's
    num_items_in_batch differs from batch to batch."""

    def __init__(self, rows: int = ROWS, length: int = 16, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (rows, length), generator=g)
        self.lengths = torch.randint(6, length + 1, (rows,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[self.lengths[i] :] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def training_args(output_dir, **overrides):
    values = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        weight_decay=0.01,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        log_level="error",
        seed=0,
    )
    values.update(overrides)
    return transformers.TrainingArguments(**values)


def logged(trainer, key: str) -> list:
    return [h[key] for h in trainer.state.log_history if "loss" in h and key in h]


def assert_close_rel(got, want, rel):
    assert len(got) == len(want) and len(want) > 0
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rel * abs(w), f"step {i + 1}: {g} vs {w} (relative tolerance {rel})"


class CountCalls:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The stock Trainer, TrainStreamTrainer with the chunked loss (saving a checkpoint at
    step 3) and without it, over the same model, data and arguments."""
    out = {}
    base = tmp_path_factory.mktemp("hf")
    stock = transformers.Trainer(
        model=tiny_causal_lm(), args=training_args(base / "stock"), train_dataset=RandomTokens()
    )
    stock.train()
    out["stock"] = stock

    def train_counting_chunked_losses(name, **kwargs):
        spy = CountCalls(trainstream.loss.causal_lm_loss)
        real, trainstream.loss.causal_lm_loss = trainstream.loss.causal_lm_loss, spy
        try:
            trainer = TrainStreamTrainer(model=tiny_causal_lm(), train_dataset=RandomTokens(), **kwargs)
            trainer.train()
        finally:
            trainstream.loss.causal_lm_loss = real
        out[name], out[name + "_calls"] = trainer, spy.calls

    args = training_args(base / "chunked", save_strategy="steps", save_steps=3)
    train_counting_chunked_losses("chunked", args=args)
    out["checkpoint"] = base / "chunked" / "checkpoint-3"
    train_counting_chunked_losses("full", args=training_args(base / "full"), trainstream={"chunked_loss": False})
    return out


# -- against the stock Trainer ---------------------------------------------------------------


def test_losses_match_the_stock_trainer(runs):
    want = logged(runs["stock"], "loss")
    assert len(want) == STEPS
    assert_close_rel(logged(runs["chunked"], "loss"), want, 2e-3)
    assert_close_rel(logged(runs["full"], "loss"), want, 2e-3)


def test_logged_grad_norm_is_the_true_global_norm(runs):
    # The stock Trainer logs the norm clip_grad_norm_ measured before clipping; p.grad is
    # None under the engine, so a Trainer that clipped p.grad would log 0.0.
    want = logged(runs["stock"], "grad_norm")
    assert len(want) == STEPS and min(want) > 1.0  # every step clips at max_grad_norm=1.0
    assert_close_rel(logged(runs["chunked"], "grad_norm"), want, 1e-4)
    assert_close_rel(logged(runs["full"], "grad_norm"), want, 1e-4)


def test_learning_rate_schedule_carries_over(runs):
    want = logged(runs["stock"], "learning_rate")
    assert len(set(want)) > 2  # the cosine schedule moves
    assert logged(runs["chunked"], "learning_rate") == pytest.approx(want, rel=1e-12)


def test_the_trainers_adamw_is_converted_with_its_groups(runs):
    trainer = runs["chunked"]
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    assert isinstance(inner, trainstream.OffloadAdamW)
    groups = inner.param_groups
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]  # the Trainer's decay groups
    assert trainer.lr_scheduler.optimizer.param_groups is groups


def test_bf16_matches_the_stock_trainer(tmp_path):
    def run(cls, path):
        trainer = cls(
            model=tiny_causal_lm(), args=training_args(path, bf16=True, max_steps=3), train_dataset=RandomTokens()
        )
        trainer.train()
        return trainer

    stock, ours = run(transformers.Trainer, tmp_path / "stock"), run(TrainStreamTrainer, tmp_path / "ours")
    assert_close_rel(logged(ours, "loss"), logged(stock, "loss"), 2e-3)
    assert_close_rel(logged(ours, "grad_norm"), logged(stock, "grad_norm"), 1e-2)


def test_model_init_wraps_each_new_model(runs, tmp_path):
    built = []

    def model_init():
        built.append(tiny_causal_lm())
        return built[-1]

    trainer = TrainStreamTrainer(model_init=model_init, args=training_args(tmp_path, max_steps=2))
    trainer.train_dataset = RandomTokens()
    trainer.train()  # builds the model again, and wraps that one
    assert len(built) == 2 and trainer.model is built[1]
    assert trainstream.memory_report(trainer.model)["params"] is not None
    # The first two steps read the same learning rate as the 6-step run: the same bits.
    assert logged(trainer, "loss") == logged(runs["chunked"], "loss")[:2]


# -- the chunked loss ------------------------------------------------------------------------


def test_chunked_loss_is_used_and_equals_the_full_logits_loss(runs):
    assert runs["chunked_calls"] == MICRO_BATCHES
    assert runs["full_calls"] == 0
    assert_close_rel(logged(runs["chunked"], "loss"), logged(runs["full"], "loss"), 1e-5)


def test_chunked_loss_refuses_a_model_that_changes_its_logits(tmp_path):
    model = tiny_causal_lm()
    head = model.lm_head

    class Scaled(torch.nn.Module):  # the model returns 2 * lm_head(x): not the layer's output
        def forward(self, x):
            return 2 * head(x)

    model.lm_head = Scaled()
    model.get_output_embeddings = lambda: head
    trainer = TrainStreamTrainer(model=model, args=training_args(tmp_path, max_steps=1), train_dataset=RandomTokens())
    with pytest.raises(RuntimeError, match="chunked_loss"):
        trainer.train()


def test_chunked_loss_on_a_model_that_is_not_a_causal_lm(tmp_path):
    def classifier():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB
        )
        config.pad_token_id = 0
        return transformers.LlamaForSequenceClassification(config)

    with pytest.warns(UserWarning, match="chunked_loss does not apply.*not a causal LM.*computes its own loss"):
        trainer = TrainStreamTrainer(model=classifier(), args=training_args(tmp_path))
    assert not trainer._ts_chunked
    model = classifier()
    with pytest.raises(ValueError, match="chunked_loss=True does not apply: LlamaForSequenceClassification"):
        TrainStreamTrainer(model=model, args=training_args(tmp_path), trainstream={"chunked_loss": True})
    assert not hasattr(model, "_trainstream_engine")


# -- resume ----------------------------------------------------------------------------------


def test_resume_from_checkpoint_equals_the_uninterrupted_run(runs, tmp_path):
    checkpoint = runs["checkpoint"]
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "model.safetensors"} <= set(os.listdir(checkpoint))
    resumed = TrainStreamTrainer(
        model=tiny_causal_lm(seed=5), args=training_args(tmp_path), train_dataset=RandomTokens()
    )
    # offload='auto' switched the uninterrupted run to torch's fused AdamW after its measured
    # steps, before the checkpoint: the resumed run must continue with that optimizer.
    assert runs["chunked"].model._trainstream_engine.mode == "stock"
    resumed.train(resume_from_checkpoint=str(checkpoint))
    want = logged(runs["chunked"], "loss")
    got = logged(resumed, "loss")
    assert got[3:] == want[3:]  # bit for bit on the CPU path
    sd, ref = resumed.model.state_dict(), runs["chunked"].model.state_dict()
    assert all(torch.equal(sd[k], ref[k]) for k in ref)


def test_the_mode_is_saved_in_the_optimizer_state_and_an_old_checkpoints_file_is_read(runs, tmp_path):
    """The checkpoint's optimizer.pt says it was saved after the switch (a plain loop loading it
    switches too); a checkpoint from before, whose own file held the mode, still resumes as the
    uninterrupted run."""
    import json
    import shutil

    from trainstream.engine.switch import MODE_KEY

    optimizer_pt = runs["checkpoint"] / "optimizer.pt"
    assert torch.load(optimizer_pt, weights_only=True)[MODE_KEY] == "stock"
    assert "trainstream_state.json" not in os.listdir(runs["checkpoint"])
    old = tmp_path / "old-checkpoint"
    shutil.copytree(runs["checkpoint"], old)
    state = torch.load(old / "optimizer.pt", weights_only=True)
    del state[MODE_KEY]
    torch.save(state, old / "optimizer.pt")
    (old / "trainstream_state.json").write_text(json.dumps({"mode": "stock"}))
    resumed = TrainStreamTrainer(
        model=tiny_causal_lm(seed=5), args=training_args(tmp_path / "out"), train_dataset=RandomTokens()
    )
    resumed.train(resume_from_checkpoint=str(old))
    assert logged(resumed, "loss")[3:] == logged(runs["chunked"], "loss")[3:]
    assert (
        f"resume: the checkpoint {old} was saved after the switch" in trainstream.memory_report(resumed.model)["events"]
    )


@pytest.mark.parametrize("paged", [False, True], ids=["resident", "paged"])
def test_resume_in_offload_mode_equals_the_uninterrupted_run(tmp_path, paged):
    options = {"offload": True, "param_offload": paged}

    def trainer(path, seed):
        args = training_args(path, max_steps=4, save_strategy="steps", save_steps=2)
        return TrainStreamTrainer(
            model=tiny_causal_lm(seed=seed), args=args, train_dataset=RandomTokens(), trainstream=options
        )

    whole = trainer(tmp_path / "whole", 0)
    whole.train()
    assert whole.model._trainstream_engine.mode == "offload"
    assert trainstream.memory_report(whole.model)["params"]["paged_blocks"] == ([0, 1] if paged else [])
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "whole" / "checkpoint-4" / "model.safetensors"))
    trained = whole.model.state_dict()  # a paged param's .data is a placeholder: the host weights
    assert saved.keys() == trained.keys() and all(torch.equal(v, trained[k]) for k, v in saved.items())
    resumed = trainer(tmp_path / "resumed", 5)  # other initial weights: the checkpoint's are loaded
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert logged(resumed, "loss")[2:] == logged(whole, "loss")[2:]
    assert logged(resumed, "grad_norm")[2:] == logged(whole, "grad_norm")[2:]


@pytest.mark.parametrize("paged", [False, True], ids=["resident", "paged"])
def test_a_bf16_model_resumes_bit_for_bit(tmp_path, paged):
    """A bf16 model: the optimizer's checkpoint carries the fp32 masters, so the resumed run
    continues from their low bits, not from the bf16 weights widened (lr 1e-2 moves a weight
    many bf16 ulps a step): the same losses, grad norms and final weights as the run that
    never stopped."""
    options = {"offload": True, "param_offload": paged}

    def trainer(path, seed):
        args = training_args(path, max_steps=4, save_strategy="steps", save_steps=2)
        model = tiny_causal_lm(seed=seed).to(torch.bfloat16)
        return TrainStreamTrainer(model=model, args=args, train_dataset=RandomTokens(), trainstream=options)

    whole = trainer(tmp_path / "whole", 0)
    whole.train()
    optimizer_file = tmp_path / "whole" / "checkpoint-2" / "optimizer.pt"
    saved = torch.load(optimizer_file, weights_only=True)["state"]
    assert saved and all(st["master"].dtype == torch.float32 for st in saved.values())
    resumed = trainer(tmp_path / "resumed", 5)
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert logged(resumed, "loss")[2:] == logged(whole, "loss")[2:]
    assert logged(resumed, "grad_norm")[2:] == logged(whole, "grad_norm")[2:]
    got, want = resumed.model.state_dict(), whole.model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# -- saving, evaluating, checkpointing -------------------------------------------------------


def test_save_model_writes_the_trained_weights(runs, tmp_path):
    trainer = runs["chunked"]
    trainer.save_model(str(tmp_path))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    trained = trainer.model.state_dict()
    fresh = tiny_causal_lm().state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, trained[name]), name
    assert not torch.equal(
        loaded.state_dict()["model.layers.0.mlp.up_proj.weight"], fresh["model.layers.0.mlp.up_proj.weight"]
    )


def test_evaluate_matches_the_stock_trainer(tmp_path):
    data = RandomTokens(rows=8, seed=3)
    stock = transformers.Trainer(model=tiny_causal_lm(), args=training_args(tmp_path / "a"), eval_dataset=data)
    ours = TrainStreamTrainer(model=tiny_causal_lm(), args=training_args(tmp_path / "b"), eval_dataset=data)
    want, got = stock.evaluate()["eval_loss"], ours.evaluate()["eval_loss"]
    assert math.isfinite(want) and got == pytest.approx(want, rel=1e-6)


def test_gradient_checkpointing_recomputes_and_trains_the_same(runs, tmp_path):
    trainer = TrainStreamTrainer(
        model=tiny_causal_lm(),
        args=training_args(tmp_path, activation_checkpointing=True),
        train_dataset=RandomTokens(),
    )
    # A module inside the layer (the layer's own hooks stay outside the checkpoint), and a
    # pre-hook: the recomputation stops once it has rebuilt what backward needs.
    inside = trainer.model.model.layers[0].mlp
    counter = CountCalls(lambda *a: None)
    inside.register_forward_pre_hook(lambda m, a: counter())
    trainer.train()
    assert trainer.model.is_activation_checkpointing
    assert counter.calls == 2 * MICRO_BATCHES  # each micro-batch's forward and its recomputation
    assert_close_rel(logged(trainer, "loss"), logged(runs["chunked"], "loss"), 1e-6)


# -- LoRA through peft -----------------------------------------------------------------------


def test_lora_trains_only_the_adapters_saves_them_and_resumes(tmp_path):
    peft = pytest.importorskip("peft")

    def lora_model(adapter_seed):
        base = tiny_causal_lm("qwen2")
        torch.manual_seed(adapter_seed)  # random B too, so that another seed gives other adapters
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
        return peft.get_peft_model(base, config)

    def trainer(model, path):
        args = training_args(path, max_steps=4, gradient_accumulation_steps=1, save_strategy="steps", save_steps=2)
        return TrainStreamTrainer(model=model, args=args, train_dataset=RandomTokens())

    model = lora_model(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    whole = trainer(model, tmp_path / "whole")
    whole.train()
    after = whole.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    adapters = {k for k in before if "lora_" in k}
    assert changed == adapters and len(adapters) == 2 * 2 * 2  # A and B of q and v, 2 layers

    checkpoint = tmp_path / "whole" / "checkpoint-2"
    files = set(os.listdir(checkpoint))
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    from safetensors.torch import load_file

    saved = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert len(saved) == len(adapters) and all("lora_" in k for k in saved)

    resumed = trainer(lora_model(2), tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert logged(resumed, "loss")[2:] == logged(whole, "loss")[2:]


@pytest.mark.parametrize(
    "state, accumulation",
    [("device state", 2), ("device state", 1), ("host", 2)],
    ids=["device-state-accum2", "device-state-accum1", "host-accum2"],
)
def test_bf16_lora_resumes_into_its_own_adapters_bit_for_bit(tmp_path, monkeypatch, state, accumulation):
    """The stock Trainer loads a peft checkpoint through load_adapter, which by default makes
    every bf16 adapter a new fp32 Parameter that the engine does not train ([Note: adapters load
    in place]): the resumed run must load into the Parameters it was wrapped with, keep them
    bf16, and go on as the uninterrupted run, bit for bit."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    from trainstream.engine import placement

    if state == "host":
        monkeypatch.setattr(placement, "DEVICE_STATE_MAX_SHARE", 0.0)

    def trainer(path, seed):
        base = tiny_causal_lm(seed=0)
        torch.manual_seed(seed)  # the adapters start elsewhere in the resumed run
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
        model = peft.get_peft_model(base, config).to(torch.bfloat16)
        args = training_args(
            path, max_steps=4, gradient_accumulation_steps=accumulation, save_strategy="steps", save_steps=2
        )
        return TrainStreamTrainer(model=model, args=args, train_dataset=RandomTokens(), trainstream={"offload": True})

    whole = trainer(tmp_path / "whole", 0)
    whole.train()
    events = trainstream.memory_report(whole.model)["events"]
    assert ("device state: the" in events) == (state == "device state")
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    resumed = trainer(tmp_path / "resumed", 5)
    wrapped_with = {n: p for n, p in resumed.model.named_parameters() if p.requires_grad}
    resumed.train(resume_from_checkpoint=str(checkpoint))
    adapters = {n: p for n, p in resumed.model.named_parameters() if p.requires_grad}
    assert adapters.keys() == wrapped_with.keys() and len(adapters) == 8
    assert all(adapters[n] is wrapped_with[n] for n in adapters)  # the same objects, trained
    assert {p.dtype for p in adapters.values()} == {torch.bfloat16}
    saved = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert all(not torch.equal(p.detach(), saved[n.replace(".default", "")]) for n, p in adapters.items())
    assert logged(resumed, "loss")[2:] == logged(whole, "loss")[2:]
    assert logged(resumed, "grad_norm")[2:] == logged(whole, "grad_norm")[2:]
    got, want = resumed.model.state_dict(), whole.model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# -- refused arguments -----------------------------------------------------------------------


def test_optim_other_than_adamw_is_refused(tmp_path):
    with pytest.raises(ValueError, match="optim='sgd'.*adamw_torch, adamw_torch_fused, adamw_hf"):
        TrainStreamTrainer(model=tiny_causal_lm(), args=training_args(tmp_path, optim="sgd"))


def test_fp16_is_refused(tmp_path):
    with pytest.raises(ValueError, match="fp16=True"):
        TrainStreamTrainer(model=tiny_causal_lm(), args=training_args(tmp_path, fp16=True))


@pytest.mark.parametrize(
    "given, match",
    [
        ({"trainstream": {"distributed": False}}, r"distributed=False with 2 processes.*different weights"),
        ({"ddp_bucket_cap_mb": 25}, r"ddp_bucket_cap_mb=25 is not supported.*not wrapped in DistributedDataParallel"),
        ({"ddp_static_graph": True}, r"ddp_static_graph=True is not supported.*accepted: None, False"),
        ({"ddp_broadcast_buffers": True}, r"ddp_broadcast_buffers=True is not supported.*never broadcasts buffers"),
    ],
    ids=["distributed-false", "bucket-cap", "static-graph", "broadcast-buffers"],
)
def test_what_data_parallel_does_not_support_is_refused_before_anything_is_wrapped(tmp_path, monkeypatch, given, match):
    """With more than one process (the spawned runs are tests/test_hf_trainer_distributed.py)
    the model is not wrapped in DDP: arguments that tune DDP, and ranks training apart, are
    refused by name."""
    monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda self: 2))
    model = tiny_causal_lm()
    arguments = {k: v for k, v in given.items() if k != "trainstream"}
    with pytest.raises(ValueError, match=match):
        TrainStreamTrainer(model=model, args=training_args(tmp_path, **arguments), trainstream=given.get("trainstream"))
    with pytest.raises(ValueError, match="not wrapped"):
        trainstream.memory_report(model)


@pytest.mark.parametrize("flag, name", [("is_deepspeed_enabled", "DeepSpeed"), ("is_fsdp_enabled", "FSDP")])
def test_deepspeed_and_fsdp_are_refused(tmp_path, flag, name):
    # The accelerate state that enables them leaks through the environment into later tests,
    # so the check is given a trainer that says it has them.
    from types import SimpleNamespace

    from trainstream.integrations.huggingface.trainer import _check_parallelism

    trainer = SimpleNamespace(args=training_args(tmp_path), **{flag: True})
    with pytest.raises(ValueError, match=rf"{name} is not supported.*shards it across the processes itself"):
        _check_parallelism(trainer, {})


@pytest.mark.parametrize(
    "options, match",
    [
        ({"chunked_los": True}, "unknown option 'chunked_los'.*did you mean 'chunked_loss'"),
        ({"nonsense": 1}, "unknown option 'nonsense'; accepted options: .*loss_chunk_size"),
        ({"chunked_loss": "yes"}, "'chunked_loss' got 'yes'; accepted: True, False"),
        ({"loss_chunk_size": 0}, "'loss_chunk_size' got 0; accepted: an integer >= 1"),
        ({"loss_chunk_size": 2.0}, "'loss_chunk_size' got 2.0"),
        ({"offload": "sometimes"}, "option 'offload' got 'sometimes'"),
        ({"quantize": "fp3"}, "option 'quantize' got 'fp3'"),
        ({"max_grad_norm": 1.0}, "'max_grad_norm' is set by TrainingArguments.max_grad_norm"),
        ({"accumulation_steps": 2}, "'accumulation_steps' is set by TrainingArguments.gradient_accumulation_steps"),
        ({"lr": 1e-3}, "'lr' is set by TrainingArguments.learning_rate"),
        ({"device": "cpu"}, "'device' is set by the device the Trainer chooses"),
    ],
)
def test_bad_trainstream_options_are_refused_by_name(tmp_path, options, match):
    model = tiny_causal_lm()
    with pytest.raises(ValueError, match=match):
        TrainStreamTrainer(model=model, args=training_args(tmp_path), trainstream=options)
    assert not hasattr(model, "_trainstream_engine")  # refused before anything was wrapped


def test_trainstream_must_be_a_dict(tmp_path):
    with pytest.raises(TypeError, match="trainstream must be a dict"):
        TrainStreamTrainer(model=tiny_causal_lm(), args=training_args(tmp_path), trainstream=["offload"])


def test_a_scheduler_on_another_optimizer_is_refused(tmp_path):
    model = tiny_causal_lm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    other = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(other, lambda step: 1.0)
    with pytest.raises(ValueError, match="optimizers=\\(optimizer, None\\)"):
        TrainStreamTrainer(model=model, args=training_args(tmp_path), optimizers=(optimizer, scheduler))


def test_a_scheduler_on_the_given_optimizer_drives_the_wrapped_one(tmp_path):
    # wrap() shares the param groups of the optimizer it converts, so a scheduler made on it
    # sets the learning rate the wrapped optimizer's updates read.
    model = tiny_causal_lm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    trainer = TrainStreamTrainer(model=model, args=training_args(tmp_path), optimizers=(optimizer, scheduler))
    scheduler.step()
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [5e-4]


def test_a_given_torch_optimizer_is_converted(tmp_path):
    model = tiny_causal_lm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.8, 0.9), weight_decay=0.5)
    trainer = TrainStreamTrainer(model=model, args=training_args(tmp_path), optimizers=(optimizer, None))
    assert isinstance(trainer.optimizer, trainstream.OffloadAdamW)
    group = trainer.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (3e-4, (0.8, 0.9), 0.5)


def test_a_wrapped_model_is_not_wrapped_again(tmp_path):
    model = tiny_causal_lm()
    trainstream.wrap(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="already wrapped"):
        TrainStreamTrainer(model=model, args=training_args(tmp_path))


# -- wrap_hf ---------------------------------------------------------------------------------


def test_wrap_hf_streams_the_decoder_layers_and_trains_without_a_cache():
    model = tiny_causal_lm("qwen2")
    model.config.use_cache = True
    layers = list(model.model.layers)
    assert decoder_layers(model) == layers
    model, optimizer = wrap_hf(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert model._trainstream_engine.stack.blocks == layers
    batch = RandomTokens(rows=2)[0]
    ids, labels = batch["input_ids"][None], batch["labels"][None]
    before = model.state_dict()["model.layers.1.mlp.down_proj.weight"].clone()
    model.train()
    out = model(input_ids=ids, labels=labels)
    assert out.past_key_values is None  # no cache while training
    out.loss.backward()  # the update may run during backward already
    optimizer.step()
    optimizer.zero_grad()
    assert not torch.equal(model.state_dict()["model.layers.1.mlp.down_proj.weight"], before)
    model.eval()
    with torch.no_grad():
        assert model(input_ids=ids).past_key_values is not None  # the config's use_cache=True again


def test_decoder_layers_of_an_encoder_decoder_are_both_stacks():
    config = transformers.T5Config(
        d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=16, vocab_size=VOCAB
    )
    model = transformers.T5ForConditionalGeneration(config)
    assert decoder_layers(model) == list(model.encoder.block) + list(model.decoder.block)


def test_wrap_hf_refuses_a_module_that_is_not_a_transformers_model():
    with pytest.raises(TypeError, match="transformers.PreTrainedModel"):
        wrap_hf(torch.nn.Linear(2, 2), None)


def test_rng_preserved_restores_every_generator():
    import random

    import numpy as np

    states = (random.getstate(), np.random.get_state()[1].copy(), torch.random.get_rng_state())
    with rng_preserved():
        random.random(), np.random.rand(), torch.rand(3)
    assert random.getstate() == states[0]
    assert (np.random.get_state()[1] == states[1]).all()
    assert torch.equal(torch.random.get_rng_state(), states[2])


# -- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_bf16_parity_with_the_stock_trainer(tmp_path):
    def run(cls, path):
        args = training_args(path, use_cpu=False, bf16=True)
        trainer = cls(model=tiny_causal_lm(), args=args, train_dataset=RandomTokens())
        trainer.train()
        return trainer

    stock = run(transformers.Trainer, tmp_path / "stock")
    ours = run(TrainStreamTrainer, tmp_path / "ours")
    assert next(ours.model.parameters()).device.type == "cuda"
    assert_close_rel(logged(ours, "loss"), logged(stock, "loss"), 1e-2)
    assert_close_rel(logged(ours, "grad_norm"), logged(stock, "grad_norm"), 1e-2)


def test_the_state_given_to_the_stock_save_leaves_the_optimizer_as_it_was():
    """_state_dict_given (data-parallel checkpoints): inside, state_dict() gives the gathered
    state; afterwards the class's method, or an instance attribute set before, is back, also
    when the save raises."""
    from trainstream.integrations.huggingface.trainer import _state_dict_given

    class Optimizer:
        def state_dict(self):
            return "the class's"

    opt = Optimizer()
    with _state_dict_given(opt, {"gathered": 1}):
        assert opt.state_dict() == {"gathered": 1}
    assert opt.state_dict() == "the class's" and "state_dict" not in vars(opt)
    own = lambda: "an instance's"  # noqa: E731
    opt.state_dict = own
    with pytest.raises(KeyError), _state_dict_given(opt, {}):
        raise KeyError("the save failed")
    assert opt.state_dict is own
