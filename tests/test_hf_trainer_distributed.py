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

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

transformers = pytest.importorskip("transformers")

import hf_models  # noqa: E402

import trainstream  # noqa: E402
from trainstream.integrations.huggingface import TrainStreamTrainer  # noqa: E402

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


def _lora_model():
    peft = pytest.importorskip("peft")
    base = _model()
    torch.manual_seed(1)  # random B too, so that the adapters' first steps move every weight
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(base, config)


def _logged(trainer, key: str) -> list:
    return [h[key] for h in trainer.state.log_history if "loss" in h and key in h]


def _state(model) -> dict:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Recording(TrainStreamTrainer):
    """Records which process wrote the weights (the Trainer's _save) and the moments it held
    right after a checkpoint's optimizer state was loaded."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.saved_weights_to: list = []
        self.loaded_optimizer_state = None

    def _save(self, output_dir=None, state_dict=None):
        self.saved_weights_to.append(os.path.basename(str(output_dir)))
        super()._save(output_dir, state_dict=state_dict)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.loaded_optimizer_state = self.optimizer.state_dict()  # every rank: a collective


def _run(trainer) -> dict:
    return {
        "loss": _logged(trainer, "loss"),
        "grad_norm": _logged(trainer, "grad_norm"),
        "state": _state(trainer.model),
        "wrapped_in": type(trainer.model_wrapped).__name__,
    }


# -- what each process runs -------------------------------------------------------------------


def _every_run(rank: int, world: int, root: str) -> dict:
    """The stock Trainer (DDP), ours with checkpoints, ours resumed from its first
    checkpoint, an evaluation, offload="auto", and LoRA: each on this process's shard."""
    out = {}
    stock = transformers.Trainer(model=_model(), args=_args(f"{root}/stock", world), train_dataset=Tokens())
    stock.train()
    out["stock"] = _run(stock)

    written = []
    real_save = torch.save

    def recording_save(obj, f, *args, **kwargs):  # what this process writes into a checkpoint
        written.append(os.path.basename(str(f)))
        return real_save(obj, f, *args, **kwargs)

    torch.save = recording_save
    try:
        args = _args(f"{root}/ours", world, save_strategy="steps", save_steps=SAVE_STEPS)
        ours = Recording(model=_model(), args=args, train_dataset=Tokens(), trainstream=ENGINE)
        ours.train()
    finally:
        torch.save = real_save
    out["ours"] = {
        **_run(ours),
        "torch_saved": written,
        "saved_weights_to": ours.saved_weights_to,
        "report": trainstream.memory_report(ours.model)["distributed"],
        "eval_loss": ours.evaluate(Tokens(rows=8, seed=3))["eval_loss"],
    }

    resumed = Recording(model=_model(seed=5), args=_args(f"{root}/resumed", world), train_dataset=Tokens())
    resumed.train(resume_from_checkpoint=f"{root}/ours/checkpoint-{SAVE_STEPS}")
    out["resumed"] = _run(resumed)

    auto = TrainStreamTrainer(model=_model(), args=_args(f"{root}/auto", world), train_dataset=Tokens())
    auto.train()
    out["auto"] = {**_run(auto), "mode": auto.model._trainstream_engine.mode}

    lora_args = _args(f"{root}/lora", world, save_strategy="steps", save_steps=STEPS)
    lora = TrainStreamTrainer(model=_lora_model(), args=lora_args, train_dataset=Tokens(), trainstream=ENGINE)
    lora.train()
    out["lora"] = _run(lora)
    return out


def _one_process(root) -> dict:
    """The same runs in one process on the same global batches: the stock Trainer, ours, and
    ours resumed from the 2-process run's first checkpoint."""
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
    return out


# -- spawning ---------------------------------------------------------------------------------


def _entry(rank: int, world: int, root: str, timeout_s: float, fn):
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
    dist.init_process_group(
        "gloo",
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


def _spawn(world: int, root, fn, timeout_s: float = 60) -> list:
    root = str(root)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, world, root, timeout_s, fn)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(JOIN_S)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    out = []
    for r in range(world):
        path = os.path.join(root, f"rank{r}.pt")
        res = torch.load(path, weights_only=False) if os.path.exists(path) else None
        assert res is not None, f"rank {r} did not finish"
        assert "error" not in res, f"rank {r}: {res['error']}"
        out.append(res)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-dp")
    ranks = _spawn(WORLD, root, _every_run)
    return {"ranks": ranks, "one": _one_process(root), "root": root}


def test_probe(runs):
    r0, r1 = runs["ranks"]
    one = runs["one"]
    for name in ("stock", "ours", "resumed", "auto", "lora"):
        print(name, r0[name]["wrapped_in"], "ranks same", _same_bits(r0[name]["state"], r1[name]["state"]))
        print("  loss", r0[name]["loss"])
        print("  gn  ", r0[name]["grad_norm"])
    for name in ("stock", "ours", "auto", "lora"):
        print(name, "1p loss", one[name]["loss"])
    print("ddp dist", _max_diff(r0["stock"]["state"], one["stock"]["state"]))
    print("ours dist", _max_diff(r0["ours"]["state"], one["ours"]["state"]))
    print("auto dist", _max_diff(r0["auto"]["state"], one["auto"]["state"]))
    print("lora dist", _max_diff(r0["lora"]["state"], one["lora"]["state"]))
    print("resumed same", _same_bits(r0["resumed"]["state"], r0["ours"]["state"]), r0["resumed"]["loss"][2:] == r0["ours"]["loss"][2:])
    print(r0["ours"]["torch_saved"], r0["ours"]["saved_weights_to"], r1["ours"]["torch_saved"], r1["ours"]["saved_weights_to"])
    print(r0["ours"]["eval_loss"], r1["ours"]["eval_loss"], r0["auto"]["mode"])
    assert 0
