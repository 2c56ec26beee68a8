"""wrap()'s options: defaults, accepted values, normalization, and the errors (SPEC.md)."""

import pytest
import torch

from trainstream import options

SPEC_DEFAULTS = {
    "optimizer_mode": "cpu",
    "offload": "auto",
    "activation_offload": "auto",
    "param_offload": "auto",
    "quantize": "auto",
    "quant_block_size": 64,
    "prefer": "exact",
    "moment_dtype": "auto",
    "device": None,
    "blocks": None,
    "distributed": None,
    "guard_params": True,
    "max_grad_norm": None,
    "accumulation_steps": 1,
    "vram_headroom": 0.10,
    "check_memory": True,
    "max_inflight_bytes": None,
    "max_activation_slowdown": 0.15,
    "prefetch_depth": 1,
    "min_offload_bytes": 1048576,
    "threads": None,
    "profile": True,
    "lr": 1e-3,
    "verbose": False,
}


def test_defaults_are_the_specification():
    parsed = options.parse({})
    assert parsed.values == SPEC_DEFAULTS
    assert parsed.given == frozenset()


@pytest.mark.parametrize(
    "name, value, normalized",
    [
        ("optimizer_mode", "gpu", "gpu"),
        ("optimizer_mode", "auto", "auto"),
        ("offload", True, True),
        ("activation_offload", False, False),
        ("activation_offload", 0.5, 0.5),
        ("activation_offload", 1, 1.0),
        ("param_offload", True, True),
        ("param_offload", 0.25, 0.25),
        ("param_offload", [3, 0, 7], [0, 3, 7]),
        ("quantize", None, "none"),
        ("quantize", False, "none"),
        ("quantize", "none", "none"),
        ("quantize", "nf4", "nf4"),
        ("quantize", "int8", "int8"),
        ("quant_block_size", 128, 128),
        ("quant_block_size", 2, 2),
        ("prefer", "speed", "speed"),
        ("moment_dtype", "bf16", torch.bfloat16),
        ("moment_dtype", "bfloat16", torch.bfloat16),
        ("moment_dtype", torch.bfloat16, torch.bfloat16),
        ("moment_dtype", "float32", torch.float32),
        ("device", "cpu", torch.device("cpu")),
        ("device", "cuda:1", torch.device("cuda", 1)),
        ("device", torch.device("cuda"), torch.device("cuda")),
        ("distributed", False, False),
        ("guard_params", False, False),
        ("max_grad_norm", 1.0, 1.0),
        ("accumulation_steps", 8, 8),
        ("vram_headroom", 0.0, 0.0),
        ("check_memory", False, False),
        ("max_inflight_bytes", 1 << 30, 1 << 30),
        ("max_activation_slowdown", 0, 0),
        ("prefetch_depth", 2, 2),
        ("min_offload_bytes", 0, 0),
        ("threads", 4, 4),
        ("profile", False, False),
        ("lr", 3e-4, 3e-4),
        ("verbose", True, True),
    ],
)
def test_accepted_values(name, value, normalized):
    parsed = options.parse({name: value})
    assert getattr(parsed, name) == normalized
    assert parsed.given == frozenset({name})


def test_blocks_accepts_a_list_of_modules():
    stack = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    assert options.parse({"blocks": stack}).blocks == stack
    assert options.parse({"blocks": torch.nn.ModuleList(stack)}).blocks == stack


@pytest.mark.parametrize(
    "name, value, accepted",
    [
        ("quantize", "fp4", "'auto', 'none', None, False, 'int8', 'nf4'"),
        ("quantize", True, "'auto', 'none'"),
        ("optimizer_mode", "tpu", "'cpu', 'gpu', 'auto'"),
        ("offload", False, "'auto', True"),
        ("activation_offload", 1.5, "a float in [0, 1]"),
        ("activation_offload", "all", "'auto', True, False"),
        ("param_offload", [1, 1], "distinct block indices"),
        ("param_offload", [-1], "block indices >= 0"),
        ("param_offload", [0.5], "block indices"),
        ("quant_block_size", 63, "an even integer >= 2"),
        ("quant_block_size", 0, "an even integer >= 2"),
        ("quant_block_size", 64.0, "an even integer >= 2"),
        ("prefer", "fast", "'exact', 'speed'"),
        ("moment_dtype", "float16", "'auto', 'float32', 'bfloat16', 'bf16', torch.bfloat16"),
        ("moment_dtype", torch.float16, "torch.bfloat16"),
        ("device", "mps", "None, 'cuda', 'cuda:N', 'cpu'"),
        ("device", "gpu0", "'cuda:N'"),
        ("device", 0, "a torch.device"),
        ("blocks", [], "a non-empty list of modules"),
        ("blocks", [torch.zeros(2)], "a non-empty list of modules"),
        ("distributed", "yes", "None, True, False"),
        ("guard_params", 1, "True, False"),
        ("max_grad_norm", 0.0, "None, a float > 0"),
        ("max_grad_norm", True, "None, a float > 0"),
        ("accumulation_steps", 0, "an integer >= 1"),
        ("accumulation_steps", True, "an integer >= 1"),
        ("vram_headroom", 1.1, "a float in [0, 1]"),
        ("vram_headroom", True, "a float in [0, 1]"),
        ("check_memory", None, "True, False"),
        ("max_inflight_bytes", 0, "integer number of bytes > 0"),
        ("max_inflight_bytes", 1.5, "integer number of bytes > 0"),
        ("max_activation_slowdown", -0.1, "a float >= 0"),
        ("prefetch_depth", 0, "an integer >= 1"),
        ("min_offload_bytes", -1, "bytes >= 0"),
        ("threads", 0, "None, an integer >= 1"),
        ("profile", "yes", "True, False, a HardwareProfile"),
        ("lr", -1e-3, "a float >= 0"),
        ("lr", "1e-3", "a float >= 0"),
        ("verbose", "loud", "True, False"),
    ],
)
def test_rejected_values_name_the_option_and_what_it_accepts(name, value, accepted):
    with pytest.raises(ValueError) as err:
        options.parse({name: value})
    message = str(err.value)
    assert f"option {name!r} got {value!r}" in message
    assert accepted in message


def test_unknown_option_suggests_the_closest_name():
    with pytest.raises(
        ValueError, match=r"unknown option 'quantise' \(did you mean 'quantize'\?\); accepted options: "
    ):
        options.parse({"quantise": "nf4"})
    with pytest.raises(ValueError, match=r"unknown option 'zzz'; accepted options: optimizer_mode, "):
        options.parse({"zzz": 1})


def test_every_option_of_the_specification_is_known():
    assert set(options.SPECS) == set(SPEC_DEFAULTS)


def test_option_names_match_the_specification_file():
    import pathlib
    import re

    spec = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "SPEC.md"
    if not spec.exists():
        pytest.skip("../shared/SPEC.md is not beside this checkout")
    text = spec.read_text().split("## trainstream.wrap", 1)[1].split("\n## ", 1)[0]
    names = set(re.findall(r"^\| `(\w+)` \|", text, flags=re.M)) - {"optimizer"}  # optimizer is positional
    assert names == set(options.SPECS)
