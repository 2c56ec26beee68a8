"""The placement at wrap(): which blocks are paged, the moment dtype, the optimizer mode, and
the numbers when the run does not fit."""

import dataclasses

import pytest
import torch
from helpers import machine
from models import tiny_mlp

import trainstream


class _Backend:
    is_cuda = True


@pytest.mark.parametrize("host_rate, expect", [(5e9, False), (2.2e9, False), (1.8e9, True), (2e8, True)])
def test_optimizer_mode_auto_weighs_the_host_rate_against_pcie(host_rate, expect, monkeypatch):
    """At 25 GB/s each way the kernel moves 8 bytes a parameter each way (resident fp32: the
    moments only): 0.4 ns at 80% of the link, 0.5 ns with the 1.25 margin. A host at 2.2e9
    params/s (0.45 ns) keeps the update; at 1.8e9 (0.56 ns) the device takes it."""
    from trainstream.engine.layout import build_units
    from trainstream.engine.placement import choose_optimizer_mode, device_update_bytes
    from trainstream.options import parse

    model, _, _ = tiny_mlp(layers=4, dim=256)
    blocks, outside, _ = build_units(model, list(model), set(model.parameters()))
    opts = parse({"optimizer_mode": "auto"})
    n = sum(p.numel() for p in model.parameters())
    assert device_update_bytes(opts, blocks + outside, 4) == (8 * n, 8 * n)  # resident fp32: the moments only
    profile = dataclasses.replace(machine(), host_adamw_params_per_s=host_rate)
    on_device, note = choose_optimizer_mode(opts, blocks + outside, profile, 4, _Backend())
    assert on_device is expect
    assert ("GPU AdamW (estimated" if expect else "host AdamW (estimated") in note
    # The CPU backend never picks the device; "gpu" is taken as asked.
    assert choose_optimizer_mode(opts, blocks, profile, 4, type("B", (), {"is_cuda": False})())[0] is False
    monkeypatch.setattr("trainstream._native.require_cuda", lambda feature: None)  # a GPU machine
    assert choose_optimizer_mode(parse({"optimizer_mode": "gpu"}), blocks, profile, 4, _Backend())[0] is True


def test_memory_error_gives_the_numbers():
    model, _, _ = tiny_mlp()
    with pytest.raises(MemoryError, match=r"host RAM: needs .* GiB .*moments.* available 0.00 GiB"):
        trainstream.wrap(model, None, device="cpu", profile=machine(ram_gib=1e-3))
    assert not hasattr(model, "_trainstream_engine")
    with pytest.raises(MemoryError, match=r"VRAM: needs .* usable 0.00 GiB"):
        trainstream.wrap(model, None, device="cpu", profile=machine(vram_gib=1e-4), param_offload=False)
    trainstream.wrap(model, None, device="cpu", check_memory=False, profile=machine(ram_gib=1e-3))


def test_auto_pages_blocks_on_a_small_simulated_card():
    # 6 blocks of 256 KiB on a 3 MiB card: half the usable memory is held back for the
    # activations not measured yet, and the weights do not fit in the rest.
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, None, device="cpu", profile=machine(vram_gib=3 / 1024))
    report = trainstream.memory_report(model)
    assert 0 < len(report["params"]["paged_blocks"]) < 6, report["events"]
    assert "plan at wrap()" in report["events"] and report["plan"]["profile"]["source"] == "given"
    loss_fn(model, batch(0, "cpu")).backward()
    opt.step()


def test_auto_moments_drop_to_bf16_only_when_ram_is_short(monkeypatch):
    model, batch, loss_fn = tiny_mlp()  # 393K params: fp32 moments need about 6 MiB of host memory in all
    wrapped, opt = trainstream.wrap(model, None, device="cpu", profile=machine(ram_gib=64))
    assert opt.moment_dtype == torch.float32
    trainstream.unwrap(wrapped)
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, None, device="cpu", profile=machine(ram_gib=5.2 / 1024))
    assert opt.moment_dtype == torch.bfloat16
    assert "bfloat16 with stochastic rounding" in trainstream.memory_report(model)["events"]
    loss_fn(model, batch(0, "cpu")).backward()
    opt.step()
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.bfloat16
    # Eight processes on the node share its RAM: a 64 GiB machine gives each an eighth.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    model, _, _ = tiny_mlp()
    with pytest.raises(MemoryError, match="share of 8"):
        trainstream.wrap(model, None, device="cpu", profile=machine(ram_gib=8 * 3.0 / 1024))


# -- plan_run: every decision from byte counts, without a model or a GPU -----------------------


def _meta_layout(blocks=4, dim=1024, frozen=False):
    """A ModelLayout of meta tensors: the byte counts of a model, no memory behind them."""
    from trainstream.engine.layout import ModelLayout, Slot, Unit

    def slot(name, shape, trainable):
        p = torch.nn.Parameter(torch.empty(shape, device="meta"), requires_grad=trainable)
        return Slot(p, name, torch.float32, trainable, True)

    block_units = [
        Unit(
            f"block {i}",
            i,
            [slot(f"layers.{i}.weight", (dim, dim), not frozen), slot(f"layers.{i}.bias", (dim,), True)],
        )
        for i in range(blocks)
    ]
    outside = [Unit("head", None, [slot("head.weight", (dim, dim), True)])]
    for u in block_units + outside:
        for s in u.slots:
            s.unit = u
    quantizable = [s for u in block_units for s in u.slots if not s.trainable and s.param.dim() == 2]
    return ModelLayout(block_units, outside, [], quantizable, [], 0)


def _as_found(layout):
    return [(u.paged, u.act_paged, [(s.quant_format, s.quant_block) for s in u.slots]) for u in layout.units]


def _plan(layout, profile, **options):
    from trainstream import options as opts_mod
    from trainstream.engine.device import Backend
    from trainstream.engine.placement import plan_run

    return plan_run(opts_mod.parse(options), layout, profile, Backend(torch.device("cpu")))


def test_plan_run_decides_from_byte_counts_and_leaves_the_units_as_found():
    from trainstream.engine.placement import Plan

    layout = _meta_layout()
    before = _as_found(layout)
    roomy = _plan(layout, machine(vram_gib=8, ram_gib=8), activation_offload=False)
    assert isinstance(roomy, Plan) and roomy.paged == () and roomy.act_paged == ()
    assert roomy.moment_dtype == torch.float32 and not roomy.update_on_device and roomy.quantize is None
    assert roomy.max_inflight_bytes == min(1 << 30, (8 << 30) // 10)
    assert (roomy.region_bytes, roomy.copy_bytes) == (roomy.max_inflight_bytes // 8, roomy.max_inflight_bytes // 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        roomy.paged = (0,)
    # Four blocks of 4 MiB weights and a 4 MiB head in 48 MiB of VRAM, half of what is usable
    # held back for activations not measured yet: some blocks, not all, are paged.
    tight = _plan(layout, machine(vram_gib=48 / 1024, ram_gib=8), activation_offload=False)
    assert 0 < len(tight.paged) < 4 and tight.budget["device_usable"] < 48 << 20
    assert _as_found(layout) == before


def test_plan_run_refuses_with_does_not_fit_carrying_the_numbers():
    from trainstream import DoesNotFit

    layout = _meta_layout()
    before = _as_found(layout)
    with pytest.raises(DoesNotFit) as raised:
        _plan(layout, machine(vram_gib=8, ram_gib=20 / 1024), moment_dtype="float32")
    e = raised.value
    assert isinstance(e, MemoryError)
    assert set(e.needs) == set(e.has) == {"vram", "ram", "pinned"}
    assert [r for r, *_ in e.short()] == ["ram"] and e.needs["ram"] > e.has["ram"] == 20 << 20
    assert len(e.problems) == 1 and e.problems[0].startswith("host RAM: needs")
    assert any("bfloat16" in s for s in e.suggestions)
    assert str(e).startswith("trainstream.wrap(): this run does not fit. host RAM: needs")
    assert _as_found(layout) == before  # a refused plan leaves the units as they were


def test_plan_run_picks_a_quantization_format_by_name_and_says_why():
    layout = _meta_layout(frozen=True)
    before = _as_found(layout)
    # The frozen weights take 16 MiB in fp32 and about 4 as int8: 16 MiB of RAM holds the run only
    # with them as NF4. wrap() turns the plan's warning into a UserWarning (test_quantized).
    plan = _plan(layout, machine(vram_gib=8, ram_gib=16 / 1024), param_offload=True, activation_offload=False)
    assert plan.quantize == "nf4" and plan.quantized == {f"layers.{i}.weight" for i in range(4)}
    assert plan.warning.startswith("trainstream.wrap(): quantize='auto' stores 4 frozen weights as nf4, because")
    assert any(n.startswith("quantize='auto': 4 frozen weights as") for n in plan.notes)
    assert _as_found(layout) == before  # the engine applies the format, not the planner
