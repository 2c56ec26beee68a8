"""The option table: wrap()'s and OffloadAdamW's options, their defaults, accepted values,
normalization and errors (SPEC.md), and the docs generated from it."""

import inspect
import os
import pathlib
import re

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
    "nonfinite": "skip",  # from "wrap() options being added"
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
        ("moment_dtype", "fp32", torch.float32),
        ("moment_dtype", torch.float32, torch.float32),
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
        ("threads", 1, 1),
        ("quant_block_size", 4096, 4096),
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
        ("quant_block_size", 4098, "an even integer >= 2 and <= 4096"),
        ("quant_block_size", 1 << 40, "an even integer >= 2 and <= 4096"),
        ("prefer", "fast", "'exact', 'speed'"),
        ("moment_dtype", "float16", "'auto', 'float32', 'fp32', torch.float32, 'bfloat16', 'bf16', torch.bfloat16"),
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
        ("threads", 0, "None, an integer from 1 to the number of cores this process may use"),
        ("threads", 100000, "None, an integer from 1 to the number of cores this process may use"),
        ("threads", 1.5, "None, an integer from 1 to the number of cores"),
        ("threads", True, "None, an integer from 1 to the number of cores"),
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
    assert set(options.options_of(options.WRAP)) == set(SPEC_DEFAULTS)


# wrap() options SPEC.md lists under "wrap() options being added" that options.py does not take
# yet; a name leaves this set in the change that adds it to the table.
PENDING_IN_SPEC: set = set()
SPEC_FILE = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "SPEC.md"


def spec_wrap_option_names() -> set[str]:
    """The option names of SPEC.md's two wrap() tables: the options and those being added."""
    if not SPEC_FILE.exists():
        pytest.skip(f"{SPEC_FILE} is absent: the specification sits in shared/ beside the checkout")
    text = SPEC_FILE.read_text()
    sections = [text.split(heading, 1)[1].split("\n## ", 1)[0] for heading in WRAP_SPEC_HEADINGS]
    names = {name for section in sections for name in re.findall(r"^\| `(\w+)` \|", section, flags=re.M)}
    return names - {"optimizer"}  # optimizer is positional


WRAP_SPEC_HEADINGS = ("## trainstream.wrap", "## wrap() options being added")


def test_option_names_match_the_specification_file():
    names = spec_wrap_option_names()
    taken = set(options.options_of(options.WRAP))
    assert names - PENDING_IN_SPEC == taken - PENDING_IN_SPEC
    assert PENDING_IN_SPEC <= names, "a pending option left SPEC.md: drop it from PENDING_IN_SPEC"


@pytest.mark.parametrize("name", sorted(PENDING_IN_SPEC))
def test_options_the_specification_is_adding(name):
    if name not in options.options_of(options.WRAP):
        pytest.xfail(f"SPEC.md lists wrap() option {name!r}; options.py does not take it yet")
    assert name in spec_wrap_option_names()


# -- one table for every caller ----------------------------------------------------------------


def test_each_entry_says_who_takes_it_and_what_it_means():
    for name, option in options.OPTIONS.items():
        assert option.used_by and set(option.used_by) <= set(options.CALLERS), name
        assert set(option.differs) <= set(option.used_by), name
        for caller in option.used_by:
            entry = options.options_of(caller)[name]
            assert entry.meaning and "\n" not in entry.meaning, (name, caller)
            assert entry.accepted, (name, caller)
            assert entry.normalize(entry.default) is not None or entry.default is None, (name, caller)


def test_offload_adamw_takes_its_keyword_options_from_the_table():
    from trainstream import OffloadAdamW

    table = options.options_of(options.OFFLOAD_ADAMW)
    signature = inspect.signature(OffloadAdamW).parameters
    assert set(table) == OFFLOAD_ADAMW_OPTIONS
    assert {name: signature[name].default for name in table} == {name: o.default for name, o in table.items()}


OFFLOAD_ADAMW_OPTIONS = {
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "mode",
    "max_grad_norm",
    "accumulation_steps",
    "moment_dtype",
    "threads",
}


def test_offload_adamw_takes_the_moment_spellings_of_wrap_except_auto():
    take = options.options_of(options.OFFLOAD_ADAMW)["moment_dtype"]
    assert take.default == "float32"
    for spelling in ("float32", "fp32", torch.float32, "bfloat16", "bf16", torch.bfloat16):
        assert take.normalize(spelling) == options.parse({"moment_dtype": spelling}).moment_dtype
    with pytest.raises(ValueError, match=r"OffloadAdamW\(\): option 'moment_dtype' got 'auto'; accepted: 'float32'"):
        options.check("moment_dtype", "auto", caller=options.OFFLOAD_ADAMW)


def test_check_names_the_caller_the_option_and_what_it_accepts():
    accepted = "None, an integer from 1 to the number of cores this process may use"
    with pytest.raises(
        ValueError, match=rf"^OffloadAdamW\(\): option 'threads' got 0; accepted: {accepted} \(\d+ here\)$"
    ):
        options.check("threads", 0, caller=options.OFFLOAD_ADAMW)
    with pytest.raises(ValueError, match=r"^convert_optimizer\(\): option 'max_grad_norm' got -1"):
        options.check("max_grad_norm", -1, caller=options.OFFLOAD_ADAMW, where="convert_optimizer()")
    assert options.check("accumulation_steps", 4, caller=options.OFFLOAD_ADAMW) == 4


def test_a_caller_cannot_check_an_option_it_does_not_take():
    with pytest.raises(KeyError):
        options.check("betas", (0.9, 0.99))  # wrap() takes no betas
    with pytest.raises(KeyError):
        options.check("prefer", "speed", caller=options.OFFLOAD_ADAMW)


# -- threads ----------------------------------------------------------------------------------


def test_threads_take_every_core_this_process_may_use():
    cores = options.available_cores()
    assert cores == (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    assert options.parse({"threads": cores}).threads == cores
    with pytest.raises(ValueError, match=rf"option 'threads' got {cores + 1}; .* \({cores} here\)"):
        options.parse({"threads": cores + 1})


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 2), (7, 7), (8, 6), (16, 14), (192, 190)])
def test_default_threads_leave_two_cores_on_a_host_of_eight_or_more(monkeypatch, cores, threads):
    monkeypatch.setattr(options, "available_cores", lambda: cores)
    assert options.default_threads() == threads


def test_the_thread_pool_resolves_none_through_default_threads(monkeypatch):
    from trainstream import ops

    monkeypatch.setattr(options, "available_cores", lambda: 9)
    assert ops.get_pool(None) is ops.get_pool(7)


# -- docs/options.md --------------------------------------------------------------------------

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "options.md"


def test_docs_options_md_is_what_the_table_generates():
    written = DOCS.read_text() if DOCS.exists() else ""
    assert written == options.options_markdown(), (
        "docs/options.md differs from the option table: regenerate it with "
        "`python -m trainstream.options > docs/options.md`"
    )


def test_the_docs_list_every_caller_and_option():
    text = options.options_markdown()
    for caller in options.CALLERS:
        assert f"## `trainstream.{caller}()`" in text
        for name in options.options_of(caller):
            assert f"| `{name}` |" in text
