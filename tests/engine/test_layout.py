"""What the engine keeps per parameter: the host copies a slot holds, and which frozen block
weights may be stored quantized."""

import copy

import torch
from helpers import PAGED, RESIDENT, assert_same_bits, train

import trainstream
from trainstream.engine.layout import NOT_MATMUL, _is_matmul_weight
from trainstream.quant import QuantizedWeight
from trainstream.quant.stored import codes_of


def test_autocast_pages_linear_weights_in_bf16():
    _, _, (model, _) = train("gpt", PAGED, autocast=torch.bfloat16, steps=2)
    engine = model._trainstream_engine
    slots = {s.name: s for u in engine.block_units for s in u.slots}
    assert torch.bfloat16 in slots["layers.0.qkv.weight"].host  # Linear: bf16 copy kept by the optimizer
    assert torch.bfloat16 not in slots["layers.0.ln1.weight"].host  # LayerNorm runs in fp32 under autocast


# -- which frozen block weights may be stored quantized -------------------------------------------


class _ZooBlock(torch.nn.Module):
    """Frozen 2+-D parameters a lossy code would change silently (a positional table indexed,
    a relative-position bias table, a convolution kernel, Mamba's A_log used through exp,
    an embedding) beside the matmul weights that may be quantized."""

    def __init__(self, d=16, length=8):
        super().__init__()
        self.pos = torch.nn.Parameter(torch.randn(length, d))
        self.rel_bias = torch.nn.Parameter(torch.randn(2 * length - 1, 2))
        self.conv = torch.nn.Conv1d(d, d, 3, padding=1)
        self.A_log = torch.nn.Parameter(torch.randn(d, 4))
        self.emb = torch.nn.Embedding(10, d)
        self.attn = torch.nn.MultiheadAttention(d, 2, batch_first=True)
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        t = x.shape[1]
        x = x + self.pos[:t] + self.emb.weight[:t]
        idx = torch.arange(t)[:, None] - torch.arange(t)[None, :] + t - 1
        bias = self.rel_bias[idx].permute(2, 0, 1).repeat(x.shape[0], 1, 1)  # (batch * heads, t, t)
        x = x + self.attn(x, x, x, attn_mask=bias, need_weights=False)[0]
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        return self.lin(x) * (-torch.exp(self.A_log)).sum(-1)


class _Zoo(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_ZooBlock() for _ in range(2))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return self.head(x)


MATMUL_WEIGHTS = ("attn.in_proj_weight", "attn.out_proj.weight", "lin.weight")
KEPT = ("pos", "rel_bias", "conv.weight", "A_log", "emb.weight")


def test_only_matmul_weights_are_quantized_and_the_rest_is_named_with_its_bytes():
    torch.manual_seed(0)
    model = _Zoo()
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith("head."))
    held = sorted(f"layers.{i}.{w}" for i in range(2) for w in MATMUL_WEIGHTS)
    reference = copy.deepcopy(model)
    with torch.no_grad():  # what the quantized model computes with: the matmul weights' round trip
        for n, p in reference.named_parameters():
            if n in held:
                p.copy_(QuantizedWeight.quantize(p, "int8").dequantize())
    assert trainstream.quantize_model(model, "int8")["tensors"] == 2 * len(MATMUL_WEIGHTS)
    assert sorted(n for n, p in model.named_parameters() if codes_of(p) is not None) == held
    x = torch.randn(2, 8, 16)
    with torch.no_grad():
        assert_same_bits(model(x), reference(x))  # every other weight kept its exact values

    torch.manual_seed(0)
    fresh = _Zoo()
    for n, p in fresh.named_parameters():
        p.requires_grad_(n.startswith("head."))
    wrapped, _ = trainstream.wrap(fresh, device="cpu", offload=True, quantize="int8", **RESIDENT)
    slots = [s for u in wrapped._trainstream_engine.block_units for s in u.slots]
    assert sorted(s.name for s in slots if s.quant is not None) == held
    kept = [s for s in slots if s.name.endswith(KEPT)]
    assert len(kept) == 2 * len(KEPT) and all(s.quant is None for s in kept)
    kib = sum(s.full_nbytes for s in kept) / 1024
    assert f"{NOT_MATMUL}: {len(kept)} tensors, {kib:.1f} KiB" in trainstream.memory_report(wrapped)["events"]


def test_transformers_fused_experts_are_matmul_weights_and_their_biases_are_not():
    from transformers import GptOssConfig, Llama4TextConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    # Llama4's experts are not declared through transformers' experts decorator: the rule
    # recognises the fused tensors by their names and expert dimension, not the decorator.
    llama4 = Llama4TextExperts(Llama4TextConfig(hidden_size=8, intermediate_size=4, num_local_experts=2))
    gpt_oss = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=4, num_local_experts=2))
    for experts in (llama4, gpt_oss):
        for n, p in experts.named_parameters():
            assert _is_matmul_weight(experts, n, p) == (n in ("gate_up_proj", "down_proj")), (type(experts), n)

    class Experts(torch.nn.Module):  # the same names outside transformers: not known
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 8, 8))

    mine = Experts()
    assert not _is_matmul_weight(mine, "gate_up_proj", mine.gate_up_proj)


# -- a unit's views: cached, made again when a plan field changes ------------------------------------


def test_a_units_views_follow_every_write_of_its_plan_fields():
    """What a unit streams and holds by kind is cached (read at every block boundary); a write
    of any plan field (Unit.paged, act_paged, recompute; Slot.quant_format, device_state), by
    whoever makes it, makes it again and moves PlanEpoch on; a copy of the unit over slots of
    its own (the planner's trials) gets views of its own slots."""
    from trainstream.engine.layout import PlanEpoch, Slot, Unit

    def slot(name, shape, trainable):
        return Slot(
            torch.nn.Parameter(torch.zeros(shape), requires_grad=trainable), name, torch.float32, trainable, True
        )

    w, b, lora = slot("w", (8, 8), False), slot("b", (8,), False), slot("lora", (2, 8), True)
    unit = Unit("block 0", 0, [w, b, lora])
    for s in unit.slots:
        s.unit = unit
    assert not unit.streamed and unit.streamed_slots == () and unit.fetch_nbytes == 0
    assert unit.views is unit.views and unit.trainable == [lora]
    epoch = PlanEpoch.value
    w.quant_format = "nf4"
    assert unit.streamed and unit.streamed_slots == (w,) and unit.fetch_nbytes == 8 * 8 * 4
    assert PlanEpoch.value > epoch
    lora.device_state = True
    assert unit.device_state_slots == (lora,) and unit.pageable_slots == (w, b) and unit.trainable == []
    unit.paged = True
    assert unit.streamed_slots == (w, b) and unit.fetch_nbytes == (64 + 8) * 4
    epoch = PlanEpoch.value
    unit.act_paged = True
    unit.recompute = False
    assert PlanEpoch.value == epoch + 2

    trial = copy.copy(unit)
    trial.slots = [copy.copy(s) for s in unit.slots]
    for s in trial.slots:
        s.unit = trial
    assert trial.streamed_slots == tuple(trial.slots[:2])  # its own slots, not the original's
    trial.paged = False
    assert trial.streamed_slots == (trial.slots[0],) and unit.streamed_slots == (w, b)
