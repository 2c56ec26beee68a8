"""TrainStreamTrainer under torchrun: 2 CPU processes over gloo, as torchrun would start them
(RANK, WORLD_SIZE, LOCAL_RANK in the environment; the process group made first, on a
FileStore with a short timeout, which accelerate then uses), joined under a deadline.

The reference for "matches one process training the same global batches" is the stock
Trainer's own DistributedDataParallel run in the same processes, on the same data: its
distance from the stock Trainer in one process (reduction-order rounding, which Adam turns
into lr-sized steps on near-zero gradients) bounds ours, three times over, from ours in one
process. One process trains the same global batches: per-device batch 2 on 2 ranks is batch
4 on one, and accelerate hands rank r the sampler's batches r, r + 2, ...
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import os

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

import hf_models  # noqa: E402
from helpers import run_ranks  # noqa: E402

import trainstream  # noqa: E402
from trainstream.integrations.huggingface import TrainStreamTrainer  # noqa: E402
from trainstream.quant import stored  # noqa: E402

WORLD = 2
PER_RANK_BATCH = 2
STEPS = 4
SAVE_STEPS = 2
ACCUMULATION = 2
# One epoch of exactly STEPS global batches, so that no rank's last batch is padded with
# samples from the epoch's start (accelerate's even_batches) where one process has none.
ROWS = STEPS * ACCUMULATION * PER_RANK_BATCH * WORLD
JOIN_S = 240  # the spawned group is killed past this: a hang fails the test, not CI
ENGINE = {"offload": True}  # the engine's own reductions (offload="auto" would switch to stock)
GPU_MODE = {**ENGINE, "optimizer_mode": "gpu"}  # on the CPU path the host AdamW stands in for the kernel


class Tokens(torch.utils.data.Dataset):
    """Token rows with a padded tail of random length (labels -100 there), so that the
    Trainer's token count differs between batches and between ranks."""

    def __init__(self, rows: int = ROWS, length: int = 12, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, hf_models.VOCAB, (rows, length), generator=g)
        self.lengths = torch.randint(5, length + 1, (rows,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[self.lengths[i] :] = -100
        return {"input_ids": self.ids[i], "labels": labels}


EVAL_ROWS = 8  # 2 batches of 2 per rank


def _args(output_dir, world: int, **overrides):
    values = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=PER_RANK_BATCH * WORLD // world,  # the same global batch
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=ACCUMULATION,
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


def _model(seed: int = 0):
    return hf_models.build("llama", seed=seed)


def _lora_model(adapter_seed: int = 1):
    peft = pytest.importorskip("peft")
    base = _model()
    torch.manual_seed(adapter_seed)  # random B too, so that the adapters' first steps move every weight
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(base, config)


# The block stack's weights: frozen and stored as NF4 codes; the embedding: frozen, in full
# precision; the norms and the output layer train.
QUANTIZED = lambda n: ".layers." in n and n.endswith("proj.weight")  # noqa: E731
FROZEN = lambda n: QUANTIZED(n) or n == "model.embed_tokens.weight"  # noqa: E731


def _frozen_model(otherwise: str | None = None, quantize: str = "nf4"):
    """A model with frozen weights, some quantized. `otherwise`: what rank 1 builds instead of
    rank 0's model: "other" (another embedding, another quantized block, another rotary
    buffer) or "permuted" (the same values of the embedding, the output layer and one
    quantized weight's codes and scales, in another order: their sums and norms are rank 0's)."""
    model = _model()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        if otherwise == "other":
            model.model.embed_tokens.weight.normal_(generator=g)
            for name, p in model.model.layers[1].named_parameters():
                if name.endswith("proj.weight"):
                    p.normal_(std=0.02, generator=g)
            model.model.rotary_emb.inv_freq.mul_(1.5)
        if otherwise == "permuted":
            for p in (model.model.embed_tokens.weight, model.lm_head.weight):
                _permute(p, g)
    for n, p in model.named_parameters():
        p.requires_grad_(not FROZEN(n))
    trainstream.quantize_model(model, quantize)
    if otherwise == "permuted":
        q = stored.codes_of(model.model.layers[0].self_attn.q_proj.weight)
        _permute(q.codes, g)
        _permute(q.absmax, g)
    return model


def _permute(t: torch.Tensor, g: torch.Generator) -> None:
    with torch.no_grad():
        flat = t.view(-1)
        moved = flat[torch.randperm(flat.numel(), generator=g)]
        assert not torch.equal(moved, flat)
        flat.copy_(moved)


def _logged(trainer, key: str) -> list:
    return [h[key] for h in trainer.state.log_history if "loss" in h and key in h]


def _state(model) -> dict:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _distance(a: dict, b: dict) -> float:
    """The Euclidean distance between two whole states (a few units in the last place on one
    element, which is all the largest difference of a LoRA's adapters is, would be noise)."""
    assert a.keys() == b.keys()
    return sum(float((a[k].double() - b[k].double()).square().sum()) for k in a) ** 0.5


def _same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Recording(TrainStreamTrainer):
    """Keeps the optimizer state it held right after a checkpoint's was loaded."""

    loaded_optimizer_state = None

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            # every rank (a collective); a copy, since the next steps write the live one
            self.loaded_optimizer_state = copy.deepcopy(self.optimizer.state_dict())


def _run(trainer) -> dict:
    return {
        "loss": _logged(trainer, "loss"),
        "grad_norm": _logged(trainer, "grad_norm"),
        "state": _state(trainer.model),
        "buffers": {k: v.detach().to("cpu", copy=True) for k, v in trainer.model.named_buffers()},
        "wrapped_in": type(trainer.model_wrapped).__name__,
    }


@contextlib.contextmanager
def _taken_from_rank_zero():
    """What the Trainer says it took from rank 0, as it logs it."""
    import logging

    said = []

    class Said(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    handler, logger = Said(), logging.getLogger("trainstream.integrations.huggingface.trainer")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield said
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# -- what each process runs -------------------------------------------------------------------


def _every_run(rank: int, world: int, root: str) -> dict:
    """The stock Trainer (DDP), ours with checkpoints (rank 1 starting from other weights),
    ours resumed from its first checkpoint, evaluations, offload="auto", and LoRA (rank 1's
    adapters initialized otherwise): each on this process's shard."""
    out = {}
    stock = transformers.Trainer(model=_model(), args=_args(f"{root}/stock", world), train_dataset=Tokens())
    stock.train()
    out["stock"] = _run(stock)

    args = _args(f"{root}/ours", world, save_strategy="steps", save_steps=SAVE_STEPS)
    # Rank 1 builds other initial weights: rank 0's are taken, as DDP broadcasts them.
    ours = Recording(model=_model(seed=0 if rank == 0 else 3), args=args, train_dataset=Tokens(), trainstream=ENGINE)
    with _recording_writes() as written, _recording_state_dicts() as state_dicts:
        ours.train()
    out["ours"] = {
        **_run(ours),
        "written": written,
        "state_dicts": state_dicts,
        "report": trainstream.memory_report(ours.model)["distributed"],
        "eval_loss": ours.evaluate(Tokens(rows=EVAL_ROWS, seed=3))["eval_loss"],
    }
    # The stock Trainer's evaluation of the last checkpoint, on the same 2 processes.
    saved = transformers.AutoModelForCausalLM.from_pretrained(f"{root}/ours/checkpoint-{STEPS}")
    stock_eval = transformers.Trainer(model=saved, args=_args(f"{root}/stock-eval", world))
    out["stock"]["eval_loss"] = stock_eval.evaluate(Tokens(rows=EVAL_ROWS, seed=3))["eval_loss"]

    resumed = Recording(
        model=_model(seed=5), args=_args(f"{root}/resumed", world), train_dataset=Tokens(), trainstream=ENGINE
    )
    resumed.train(resume_from_checkpoint=f"{root}/ours/checkpoint-{SAVE_STEPS}")
    out["resumed"] = _run(resumed)

    # save_on_each_node: each node's first process saves (here rank 0, the one node's), and
    # every rank gets the whole optimizer state.
    args = _args(f"{root}/each-node", world, save_strategy="steps", save_steps=SAVE_STEPS, save_on_each_node=True)
    each_node = TrainStreamTrainer(model=_model(), args=args, train_dataset=Tokens(), trainstream=ENGINE)
    with _recording_writes() as written, _recording_state_dicts() as state_dicts:
        each_node.train()
    out["each_node"] = {"written": written, "state_dicts": state_dicts}

    from trainstream import options as ts_options

    ts_options.CPU_STANDS_IN_FOR_GPU_OPTIMIZER = True  # as tests/conftest.py sets it in this process
    in_gpu_mode = TrainStreamTrainer(
        model=_model(), args=_args(f"{root}/gpu-mode", world), train_dataset=Tokens(), trainstream=GPU_MODE
    )
    in_gpu_mode.train()
    out["gpu_mode"] = {
        **_run(in_gpu_mode),
        "mode": trainstream.memory_report(in_gpu_mode.model)["plan"]["optimizer_mode"],
    }

    auto = TrainStreamTrainer(model=_model(), args=_args(f"{root}/auto", world), train_dataset=Tokens())
    auto.train()
    out["auto"] = {**_run(auto), "mode": auto.model._trainstream_engine.mode}

    lora_args = _args(f"{root}/lora", world, save_strategy="steps", save_steps=STEPS)
    lora = TrainStreamTrainer(model=_lora_model(1 + rank), args=lora_args, train_dataset=Tokens(), trainstream=ENGINE)
    lora.train()
    out["lora"] = _run(lora)
    stock_lora = transformers.Trainer(
        model=_lora_model(), args=_args(f"{root}/stock-lora", world), train_dataset=Tokens()
    )
    stock_lora.train()
    out["stock_lora"] = _run(stock_lora)

    # Frozen weights (some stored quantized) and buffers: rank 1 builds the same as rank 0, then
    # others, then the same values permuted.
    for name, otherwise in (("frozen", None), ("frozen_other", "other"), ("frozen_permuted", "permuted")):
        with _taken_from_rank_zero() as said:
            frozen = TrainStreamTrainer(
                model=_frozen_model(otherwise if rank == 1 else None),
                args=_args(f"{root}/{name}", world),
                train_dataset=Tokens(),
                trainstream=ENGINE,
            )
        frozen.train()
        out[name] = {**_run(frozen), "said": said}

    # ddp_broadcast_buffers=False: DDP leaves the buffers out of what it broadcasts, and so
    # does the Trainer (rank 1 keeps its own rotary buffer; its weights are still rank 0's).
    args = _args(f"{root}/own-buffers", world, ddp_broadcast_buffers=False)
    own = _frozen_model("other" if rank == 1 else None)
    TrainStreamTrainer(model=own, args=args, train_dataset=Tokens(), trainstream=ENGINE)
    out["own_buffers"] = {k: v.detach().clone() for k, v in own.named_buffers()}
    out["own_buffers_embedding"] = own.model.embed_tokens.weight.detach().clone()

    # Rank 1 stores its block weights as int8 codes, rank 0 as NF4 (the same names, shapes and
    # dtypes, which wrap() compares): refused on every rank, before anything is sent.
    codes = _frozen_model(quantize="int8" if rank == 1 else "nf4")
    try:
        TrainStreamTrainer(model=codes, args=_args(f"{root}/codes", world), train_dataset=Tokens())
    except ValueError as e:
        out["other_codes"] = str(e)

    # Rank 1 with one layer fewer: refused on every rank, before anything trains.
    other = _model() if rank == 0 else hf_models.build("llama", num_hidden_layers=2)
    try:
        TrainStreamTrainer(model=other, args=_args(f"{root}/other", world), train_dataset=Tokens())
    except ValueError as e:
        out["other_model"] = str(e)
    return out


@contextlib.contextmanager
def _recording_writes():
    """The names of the files this process writes through torch.save and transformers'
    safetensors writer."""
    import transformers.modeling_utils as modeling_utils

    written = []
    real_save, real_safe_save = torch.save, modeling_utils.safe_save_file

    def save(obj, f, *args, **kwargs):
        written.append(os.path.basename(str(f)))
        return real_save(obj, f, *args, **kwargs)

    def safe_save(tensors, filename, *args, **kwargs):
        written.append(os.path.basename(str(filename)))
        return real_safe_save(tensors, filename, *args, **kwargs)

    torch.save, modeling_utils.safe_save_file = save, safe_save
    try:
        yield written
    finally:
        torch.save, modeling_utils.safe_save_file = real_save, real_safe_save


@contextlib.contextmanager
def _recording_state_dicts():
    """Each call of the wrapped optimizer's state_dict() on this process while the Trainer
    saves the optimizer (accelerate calls it too, when it prepares the optimizer): whether it
    was asked with rank0_only=True, and whether it gave the "whole" state or an "empty" dict."""
    from trainstream.engine.optimizer import StreamedAdamW

    calls, saving = [], []
    real, real_save = StreamedAdamW.state_dict, TrainStreamTrainer._save_optimizer_and_scheduler

    def state_dict(self, *args, **kwargs):
        sd = real(self, *args, **kwargs)
        if saving:
            calls.append((kwargs.get("rank0_only", False), "whole" if sd.get("state") else "empty"))
        return sd

    def save(self, output_dir):
        saving.append(output_dir)
        try:
            real_save(self, output_dir)
        finally:
            saving.pop()

    StreamedAdamW.state_dict, TrainStreamTrainer._save_optimizer_and_scheduler = state_dict, save
    try:
        yield calls
    finally:
        StreamedAdamW.state_dict, TrainStreamTrainer._save_optimizer_and_scheduler = real, real_save


def _one_process(root) -> dict:
    """The same runs in one process on the same global batches, and ours resumed from the
    2-process run's first checkpoint."""
    out = {}
    stock = transformers.Trainer(model=_model(), args=_args(root / "stock1", 1), train_dataset=Tokens())
    stock.train()
    out["stock"] = _run(stock)
    ours = TrainStreamTrainer(model=_model(), args=_args(root / "ours1", 1), train_dataset=Tokens(), trainstream=ENGINE)
    ours.train()
    out["ours"] = _run(ours)
    auto = TrainStreamTrainer(model=_model(), args=_args(root / "auto1", 1), train_dataset=Tokens())
    auto.train()
    out["auto"] = _run(auto)
    lora = TrainStreamTrainer(
        model=_lora_model(), args=_args(root / "lora1", 1), train_dataset=Tokens(), trainstream=ENGINE
    )
    lora.train()
    out["lora"] = _run(lora)
    stock_lora = transformers.Trainer(model=_lora_model(), args=_args(root / "stock-lora1", 1), train_dataset=Tokens())
    stock_lora.train()
    out["stock_lora"] = _run(stock_lora)
    # The 2-process run's first checkpoint, resumed alone.
    resumed = Recording(
        model=_model(seed=5), args=_args(root / "resumed1", 1), train_dataset=Tokens(), trainstream=ENGINE
    )
    resumed.train(resume_from_checkpoint=str(root / "ours" / f"checkpoint-{SAVE_STEPS}"))
    out["resumed"] = {**_run(resumed), "loaded": resumed.loaded_optimizer_state}
    return out


# -- spawning ---------------------------------------------------------------------------------


def _entry(rank: int, world: int, root: str, timeout_s: float, fn, backend: str):
    # What torchrun sets; accelerate reads it and uses the process group made here.
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{os.path.join(root, 'store')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world, root)
    except BaseException as e:  # the parent reads what each rank raised
        import traceback

        result = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    torch.save(result, os.path.join(root, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _spawn(world: int, root, fn, timeout_s: float = 60, backend: str = "gloo") -> list:
    root = str(root)
    out = run_ranks(_entry, world, root, lambda r: (r, world, root, timeout_s, fn, backend), JOIN_S)
    for r, res in enumerate(out):
        assert res is not None, f"rank {r} did not finish"
        assert "error" not in res, f"rank {r}: {res['error']}"
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-dp")
    ranks = _spawn(WORLD, root, _every_run)
    return {"ranks": ranks, "one": _one_process(root), "root": root}


def _ddp_distance(runs, name: str = "stock") -> float:
    """How far torch's DDP, through the stock Trainer on 2 processes, ends from the stock
    Trainer in one process."""
    distance = _distance(runs["ranks"][0][name]["state"], runs["one"][name]["state"])
    assert distance > 0  # else the bound below would say nothing about rounding
    return distance


def _loss_distance(a: list, b: list) -> float:
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) for x, y in zip(a, b))


# -- training ---------------------------------------------------------------------------------


def test_no_ddp_wrapper_and_every_rank_ends_with_the_same_bits(runs):
    r0, r1 = runs["ranks"]
    assert r0["stock"]["wrapped_in"] == "DistributedDataParallel"  # what the stock Trainer does here
    for name in ("ours", "resumed", "auto", "lora"):
        assert r0[name]["wrapped_in"] == r1[name]["wrapped_in"] != "DistributedDataParallel", name
        assert _same_bits(r0[name]["state"], r1[name]["state"]), name
    report = r0["ours"]["report"]  # the engine trained data parallel: each rank updates half
    assert report["world_size"] == WORLD and report["shard_elements"] <= report["trainable_elements"] // 2 + 64


def test_optimizer_mode_gpu_trains_as_the_host_adamw_on_every_rank(runs):
    """trainstream={"optimizer_mode": "gpu"} under torchrun: the engine's data parallel with the
    device update's layout, the same bits and logged losses as the host AdamW's run."""
    for r in runs["ranks"]:
        assert r["gpu_mode"]["mode"] == "gpu" and r["gpu_mode"]["wrapped_in"] != "DistributedDataParallel"
        assert _same_bits(r["gpu_mode"]["state"], r["ours"]["state"])
        assert r["gpu_mode"]["loss"] == r["ours"]["loss"] and r["gpu_mode"]["grad_norm"] == r["ours"]["grad_norm"]


def test_weights_match_one_process_within_three_times_ddps_distance(runs):
    """Rank 1 built other initial weights, and one process rank 0's: rank 0's were taken."""
    ddp = _ddp_distance(runs)
    r0, one = runs["ranks"][0], runs["one"]
    assert _distance(r0["ours"]["state"], one["ours"]["state"]) <= 3 * ddp
    # offload="auto" switches both to stock training after its measured steps (on 2 ranks
    # the gradients are then averaged at the end of each backward, as DDP does).
    assert r0["auto"]["mode"] == "stock"
    assert _distance(r0["auto"]["state"], one["auto"]["state"]) <= 3 * ddp


def test_logged_losses_and_grad_norms_match_the_stock_ddp_run(runs):
    r0, r1, one = *runs["ranks"], runs["one"]
    ddp = _loss_distance(r0["stock"]["loss"], one["stock"]["loss"])
    # The loss is averaged over the ranks as the stock Trainer averages it: every rank logs
    # the same, within DDP's own distance of one process (three times over).
    assert r0["ours"]["loss"] == r1["ours"]["loss"]
    assert _loss_distance(r0["ours"]["loss"], one["ours"]["loss"]) <= 3 * ddp
    for got, want in zip(r0["ours"]["loss"], r0["stock"]["loss"]):
        assert got == pytest.approx(want, rel=1e-5)
    # The engine's global norm across ranks, as clip_grad_norm_ measures DDP's averaged p.grad.
    norms = r0["ours"]["grad_norm"]
    assert norms == r1["ours"]["grad_norm"] and len(norms) == STEPS and min(norms) > 1.0  # every step clips
    for got, want in zip(norms, r0["stock"]["grad_norm"]):
        assert got == pytest.approx(want, rel=1e-4)


def test_lora_trains_only_the_adapters_as_one_process(runs):
    r0, one = runs["ranks"][0], runs["one"]
    before = _state(_lora_model())
    after = r0["lora"]["state"]
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {k for k in before if "lora_" in k} and changed
    assert _distance(after, one["lora"]["state"]) <= 3 * _ddp_distance(runs, "stock_lora")
    files = set(os.listdir(runs["root"] / "lora" / f"checkpoint-{STEPS}"))
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files


# -- checkpoints ------------------------------------------------------------------------------


def test_only_the_main_process_writes_the_checkpoint_and_it_holds_the_whole_state(runs):
    from safetensors.torch import load_file

    r0, r1 = runs["ranks"]
    per_checkpoint = {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pth"}
    assert per_checkpoint <= set(r0["ours"]["written"])
    assert set(r1["ours"]["written"]) == {"rng_state_1.pth"}  # each rank saves its own RNG state only
    last = runs["root"] / "ours" / f"checkpoint-{STEPS}"
    saved = load_file(str(last / "model.safetensors"))
    trained = r0["ours"]["state"]
    assert saved.keys() <= trained.keys() and all(torch.equal(v, trained[k]) for k, v in saved.items())
    # The moments gathered whole from both ranks' shards, each in its parameter's shape.
    shapes = sorted(tuple(v.shape) for k, v in trained.items() if k in saved)
    state = torch.load(last / "optimizer.pt", weights_only=True)["state"]
    assert sorted(tuple(st["exp_avg"].shape) for st in state.values()) == shapes
    assert all(float(st["exp_avg_sq"].abs().sum()) > 0 for st in state.values())


def test_resume_with_two_processes_continues_bit_for_bit(runs):
    # Each checkpoint's optimizer state was gathered to rank 0, which saved it, alone: rank 1's
    # state_dict() only sent its shards and gave {}.
    r0, r1 = runs["ranks"]
    assert r0["ours"]["state_dicts"] == [(True, "whole")] * (STEPS // SAVE_STEPS)
    assert r1["ours"]["state_dicts"] == [(True, "empty")] * (STEPS // SAVE_STEPS)
    for rank in runs["ranks"]:
        assert rank["resumed"]["loss"][SAVE_STEPS:] == rank["ours"]["loss"][SAVE_STEPS:]
        assert rank["resumed"]["grad_norm"][SAVE_STEPS:] == rank["ours"]["grad_norm"][SAVE_STEPS:]
        assert _same_bits(rank["resumed"]["state"], rank["ours"]["state"])


def test_resume_with_one_process_loads_the_whole_state_and_continues_within_ddps_distance(runs):
    """Alone, the sums over the global batch round otherwise than 2 ranks' mean: exact up to
    the load, then within DDP's own distance."""
    saved = torch.load(runs["root"] / "ours" / f"checkpoint-{SAVE_STEPS}" / "optimizer.pt", weights_only=True)
    loaded = runs["one"]["resumed"]["loaded"]
    assert saved["state"].keys() == loaded["state"].keys()
    for i, st in saved["state"].items():
        assert all(torch.equal(v, loaded["state"][i][k]) for k, v in st.items()), i
    r0, resumed = runs["ranks"][0]["ours"], runs["one"]["resumed"]
    ddp = _ddp_distance(runs)
    assert _distance(resumed["state"], r0["state"]) <= 3 * ddp
    ddp_loss = _loss_distance(runs["ranks"][0]["stock"]["loss"], runs["one"]["stock"]["loss"])
    for got, want in zip(resumed["loss"][SAVE_STEPS:], r0["loss"][SAVE_STEPS:]):
        assert abs(got - want) <= 3 * ddp_loss


def test_with_save_on_each_node_every_rank_gets_the_whole_optimizer_state(runs):
    """Each node's first process saves: the state is not gathered to rank 0 alone."""
    r0, r1 = runs["ranks"]
    for rank in (r0, r1):
        assert rank["each_node"]["state_dicts"] == [(False, "whole")] * (STEPS // SAVE_STEPS)
    assert "optimizer.pt" in r0["each_node"]["written"] and "optimizer.pt" not in r1["each_node"]["written"]
    saved = torch.load(runs["root"] / "each-node" / f"checkpoint-{STEPS}" / "optimizer.pt", weights_only=True)
    shapes = sorted(tuple(p.shape) for p in _model().parameters())
    assert sorted(tuple(st["exp_avg"].shape) for st in saved["state"].values()) == shapes


def test_frozen_weights_that_agree_are_compared_and_not_sent(runs):
    for rank in runs["ranks"]:
        assert rank["frozen"]["said"] == []
    r0, r1 = runs["ranks"]
    assert _same_bits(r0["frozen"]["state"], r1["frozen"]["state"])
    assert stored.codes_of(_frozen_model().model.layers[0].mlp.up_proj.weight) is not None  # a quantized base


@pytest.mark.parametrize("otherwise", ["other", "permuted"])
def test_frozen_weights_quantized_codes_and_buffers_rank_1_built_otherwise_are_rank_0s(runs, otherwise):
    """Rank 1's frozen embedding, quantized block weights and rotary buffer differ (other), or
    hold rank 0's values permuted (with a trainable weight's: their sums and norms agree):
    rank 0's are taken, as DDP broadcasts them, and the run is the one where both ranks
    built rank 0's model, bit for bit."""
    r0, r1 = runs["ranks"]
    name = f"frozen_{otherwise}"
    want = r0["frozen"]
    for r, rank in enumerate((r0, r1)):
        got = rank[name]
        assert _same_bits(got["state"], want["state"]), f"rank {r}"
        assert _same_bits(got["buffers"], want["buffers"]), f"rank {r}"
        assert got["loss"] == want["loss"], f"rank {r}"
    taken = {
        "other": ["model.embed_tokens.weight"]
        + [
            f"model.layers.1.{n}"
            for n, _ in _frozen_model().model.layers[1].named_parameters()
            if n.endswith("proj.weight")
        ]
        + ["model.rotary_emb.inv_freq"],
        "permuted": ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"],
    }[otherwise]
    for rank in (r0, r1):
        (said,) = rank[name]["said"]
        assert said == f"TrainStreamTrainer: took rank 0's {', '.join(taken)} (they differed on some rank)"


def test_with_ddp_broadcast_buffers_false_each_rank_keeps_its_buffers_as_under_ddp(runs):
    r0, r1 = runs["ranks"]
    assert torch.equal(r0["own_buffers_embedding"], r1["own_buffers_embedding"])
    mine, zero = r1["own_buffers"], r0["own_buffers"]
    assert torch.equal(mine["model.rotary_emb.inv_freq"], 1.5 * zero["model.rotary_emb.inv_freq"])


def test_weights_quantized_otherwise_on_one_rank_are_refused_on_every_rank(runs):
    for rank in runs["ranks"]:
        said = rank.get("other_codes", "")
        assert "data parallel needs the same model on every rank" in said
        assert "the first that differs from rank 0's is parameter model.layers.0.self_attn.q_proj.weight" in said


def test_a_model_that_differs_between_ranks_is_refused_on_every_rank(runs):
    for rank in runs["ranks"]:
        assert "data parallel needs the same model on every rank" in rank.get("other_model", "")


def test_evaluate_on_two_processes_equals_the_stock_trainers(runs):
    """Each rank evaluates its shard and the losses are gathered, as the stock Trainer does on
    the same processes (over the saved weights: the checkpoint holds the trained ones)."""
    r0, r1 = runs["ranks"]
    assert r0["ours"]["eval_loss"] == r1["ours"]["eval_loss"]
    assert r0["ours"]["eval_loss"] == pytest.approx(r0["stock"]["eval_loss"], rel=1e-6)


# -- GPU --------------------------------------------------------------------------------------


def _module_of_rank(rank: int, device: str) -> torch.nn.Module:
    """A Linear (frozen bias) and a buffer, initialized from `rank`."""
    torch.manual_seed(rank)
    module = torch.nn.Linear(300, 200)
    module.bias.requires_grad_(False)
    module.register_buffer("scale", torch.randn(7))
    return module.to(device)


def _rank_zeros_on(rank: int, world: int, root: str, device: str) -> dict:
    from trainstream.integrations.huggingface import trainer as trainer_module

    module = _module_of_rank(rank, device)
    trainer_module.DIGEST_CHUNK_BYTES = 4096  # many chunks of each device tensor
    taken = trainer_module._from_rank_zero(module, buffers=True)
    return {"taken": taken, "state": {k: v.detach().cpu() for k, v in module.state_dict().items()}}


def _check_rank_zeros(ranks) -> None:
    want = _module_of_rank(0, "cpu").state_dict()
    for rank in ranks:
        assert rank["taken"] == ["weight", "bias", "scale"]
        assert _same_bits(rank["state"], want)


def test_rank_zeros_tensors_taken_on_the_host_directly(tmp_path):
    _check_rank_zeros(_spawn(WORLD, tmp_path, functools.partial(_rank_zeros_on, device="cpu")))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per process)")
def test_rank_zeros_tensors_on_the_gpu_digested_in_chunks_and_taken(tmp_path):
    ranks = _spawn(WORLD, tmp_path, functools.partial(_rank_zeros_on, device="cuda"), timeout_s=120, backend="nccl")
    _check_rank_zeros(ranks)


def _on_gpus(rank: int, world: int, root: str) -> dict:
    """bf16 on one GPU per process (NCCL default group, as torchrun gives): the stock
    Trainer's DDP run, then ours with a checkpoint."""
    gpu = dict(use_cpu=False, bf16=True)
    stock = transformers.Trainer(model=_model(), args=_args(f"{root}/stock", world, **gpu), train_dataset=Tokens())
    stock.train()
    args = _args(f"{root}/ours", world, save_strategy="steps", save_steps=STEPS, **gpu)
    ours = TrainStreamTrainer(model=_model(), args=args, train_dataset=Tokens(), trainstream=ENGINE)
    ours.train()
    return {"stock": _run(stock), "ours": _run(ours), "device": str(ours.args.device)}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per process)")
def test_two_gpus_bf16_every_rank_the_same_bits_and_the_stock_ddp_losses(tmp_path):
    from safetensors.torch import load_file

    r0, r1 = _spawn(WORLD, tmp_path, _on_gpus, timeout_s=120, backend="nccl")
    assert (r0["device"], r1["device"]) == ("cuda:0", "cuda:1")
    assert r0["ours"]["wrapped_in"] != "DistributedDataParallel"
    assert _same_bits(r0["ours"]["state"], r1["ours"]["state"])
    assert r0["ours"]["loss"] == r1["ours"]["loss"]
    for got, want in zip(r0["ours"]["loss"], r0["stock"]["loss"]):  # bf16 autocast on both
        assert got == pytest.approx(want, rel=1e-2)
    saved = load_file(str(tmp_path / "ours" / f"checkpoint-{STEPS}" / "model.safetensors"))
    assert all(torch.equal(v, r0["ours"]["state"][k]) for k, v in saved.items())
