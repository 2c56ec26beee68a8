"""load_model(): a transformers causal LM built from its config with every parameter on the
meta device, then filled one tensor at a time from its .safetensors shards (or initialized,
random_weights=True). Each frozen block weight is quantized as soon as it is read, so a
quantized base never exists in full precision: host memory while loading stays near the
quantized size plus the tensor being read (the shards are memory-mapped; their pages are
the file's, not the process's).

What is quantized is what wrap(quantize=...) would quantize (quant.model.block_slots): the
weight tensors of the block stack. The model comes back with those parameters holding
their codes (quant.stored), which wrap() then streams as they are.
"""

from __future__ import annotations

import contextlib
import difflib
import glob
import json
import logging
import math
import os
import re

import torch

from ...errors import DoesNotFit
from ...quant import stored
from ...quant.model import block_slots, check_block_size
from ...quant.weight import QuantizedWeight, quantized_nbytes
from ...sizes import GiB
from .random_draws import parallel_draws

CALLER = "load_model()"
QUANTIZE = ("auto", "none", "int8", "nf4")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX = "model.safetensors.index.json"
VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the quantize ops read

log = logging.getLogger(__name__)
# A checkpoint of MoE experts one module each (Mixtral's ...experts.3.w1.weight), where
# transformers 5 models hold one fused tensor per block.
_PER_EXPERT = re.compile(r"\.experts\.\d+\.")
# The MoE families whose per-expert checkpoints load_model fuses as it reads: model_type ->
# (the checkpoint's name for the model's ".mlp." of a MoE block; the per-expert names of the
# gate, up and down projections). transformers 5 holds, per block, gate_up_proj[e] =
# cat(gate_e, up_e) (rows: gate first) and down_proj[e] = down_e; only families whose fused
# layout is exactly that are listed (each is compared against transformers' own loading in
# tests/test_load_model.py), others stay refused by name.
_EXPERT_LAYOUTS = {
    "mixtral": (".block_sparse_moe.", ("w1", "w3", "w2")),
    "qwen2_moe": (".mlp.", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": (".mlp.", ("gate_proj", "up_proj", "down_proj")),
}
_FUSED = re.compile(r"^(?P<block>.*)\.mlp\.experts\.(?P<kind>gate_up_proj|down_proj)$")


def _checkpoint_names(model, name: str) -> list[str]:
    """The names a checkpoint may give the model's tensor `name`: as is, with or without the
    model's base prefix ("model.", "transformer.": checkpoints of the bare model lack it), and,
    for a MoE family of _EXPERT_LAYOUTS, with its MoE module's checkpoint name."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    names = [name]
    if prefix and name.startswith(prefix + "."):
        names.append(name[len(prefix) + 1 :])
    elif prefix:
        names.append(f"{prefix}.{name}")
    layout = _EXPERT_LAYOUTS.get(getattr(model.config, "model_type", None))
    if layout is not None and layout[0] != ".mlp.":
        names += [n.replace(".mlp.", layout[0]) for n in names if ".mlp." in n]
    return names


class _FusedExperts:
    """A fused expert parameter read from per-expert checkpoint tensors: `parts[e]` lists the
    keys whose rows, concatenated, are expert e's slice (gate then up, or down alone)."""

    def __init__(self, parts: list[list[str]]):
        self.parts = parts

    def keys(self) -> list[str]:
        return [k for part in self.parts for k in part]

    def shape(self, checkpoint) -> tuple | None:
        """The fused shape, or None when the experts' slices disagree in shape."""
        slices = set()
        for part in self.parts:
            shapes = [checkpoint.shape(k) for k in part]
            if any(len(sh) != 2 or sh[1] != shapes[0][1] for sh in shapes):
                return None
            slices.add((sum(sh[0] for sh in shapes), shapes[0][1]))
        return (len(self.parts), *slices.pop()) if len(slices) == 1 else None

    def read(self, checkpoint) -> torch.Tensor:
        """One block's fused tensor, written slice by slice: the only full-precision copy of
        its experts that exists while loading (the per-expert tensors are memory-mapped)."""
        out = None
        for e, part in enumerate(self.parts):
            row = 0
            for k in part:
                piece = checkpoint.read(k)
                if out is None:
                    out = torch.empty(self.shape(checkpoint), dtype=piece.dtype)
                out[e, row : row + piece.shape[0]].copy_(piece)
                row += piece.shape[0]
        return out


def _fused_experts(model, name: str, checkpoint) -> _FusedExperts | None:
    """The per-expert checkpoint tensors of the fused parameter `name`, when the model's family
    is one _EXPERT_LAYOUTS converts and the checkpoint holds every one of them."""
    layout = _EXPERT_LAYOUTS.get(getattr(model.config, "model_type", None))
    found = _FUSED.match(name)
    if layout is None or found is None:
        return None
    gate, up, down = layout[1]
    names = (gate, up) if found["kind"] == "gate_up_proj" else (down,)
    for base in _checkpoint_names(model, f"{found['block']}.mlp.experts"):
        count = 0
        while f"{base}.{count}.{names[0]}.weight" in checkpoint.where:
            count += 1
        parts = [[f"{base}.{e}.{n}.weight" for n in names] for e in range(count)]
        if count and all(k in checkpoint.where for part in parts for k in part):
            return _FusedExperts(parts)
    return None


def load_model(
    name_or_path,
    *,
    quantize="auto",
    dtype=torch.bfloat16,
    quant_block_size=64,
    random_weights=False,
    ram_fraction=0.85,
    trust_remote_code=False,
    **config_overrides,
) -> torch.nn.Module:
    """A transformers causal LM (``AutoModelForCausalLM``; ``AutoModelForSeq2SeqLM`` for an
    encoder-decoder config) from a folder or a hub id, read one tensor at a time.

    `name_or_path`: a folder with config.json and .safetensors shards (model.safetensors, or
    the shards model.safetensors.index.json lists), or a hub id: downloaded with
    huggingface_hub when the hub answers, taken from the local cache otherwise.
    `quantize`: "none" (also None or False), "int8", "nf4", or "auto": quantize only if the
    model in `dtype` would not fit in `ram_fraction` of the available RAM (this process's
    share), int8 before NF4; DoesNotFit when even NF4 would not. `dtype`: the model's
    floating-point dtype (float32, bfloat16 or float16). `quant_block_size`: values per fp32
    scale. `random_weights`: no checkpoint is read (only config.json); every tensor is
    initialized by the model's own ``_init_weights`` (one module at a time, each block weight
    quantized right after; large draws run on every core, random_draws.py), as a benchmark of
    a base's shapes: ``torch.manual_seed`` before the call fixes the values.
    `config_overrides`: fields of the config to change (an unknown field is a ValueError
    naming it).

    What trains: quantized ("int8", "nf4", or "auto" that quantized), every parameter comes
    back frozen (requires_grad=False), the base of a LoRA (add adapters with peft, or unfreeze
    what you mean to train: never a quantized weight). "none": requires_grad as transformers
    leaves it (all True), for a full fine-tune. Tied embeddings stay tied; biases, norms,
    embeddings and the output layer load as they are, in `dtype`. The model is returned in
    eval() mode, as ``from_pretrained`` returns it.

    Errors name what is wrong: a folder with only .bin files, a tensor the model needs that
    no shard holds, a shape that differs from the config's, an unknown config field.
    """
    fmt = _check_quantize(quantize)
    if dtype not in DTYPES:
        raise ValueError(f"{CALLER}: dtype must be one of {[str(d) for d in DTYPES]}, got {dtype!r}")
    block_size = check_block_size(quant_block_size, CALLER, "quant_block_size")
    for name, value in (("random_weights", random_weights), ("trust_remote_code", trust_remote_code)):
        if not isinstance(value, bool):
            raise ValueError(f"{CALLER}: {name} must be True or False, got {value!r}")
    if isinstance(ram_fraction, bool) or not isinstance(ram_fraction, (int, float)) or not 0 < ram_fraction <= 1:
        raise ValueError(f"{CALLER}: ram_fraction must be a number in (0, 1], got {ram_fraction!r}")
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"{CALLER}: name_or_path must be a folder or a hub id (str), got {type(name_or_path).__name__}")

    folder = resolve(os.fspath(name_or_path), random_weights)
    config = read_config(folder, trust_remote_code, config_overrides)
    checkpoint = None if random_weights else Checkpoint(folder)
    with contextlib.ExitStack() as stack:
        if checkpoint is not None:
            stack.enter_context(checkpoint)
        model = build_on_meta(config, dtype, trust_remote_code)
        fmt = choose_format(model, fmt, ram_fraction, block_size)
        if fmt is not None:
            for p in model.parameters():
                p.requires_grad_(False)
        quantized = _quantized_blocks(model) if fmt is not None else {}
        fill = _Filler(model, quantized, fmt, block_size)
        if checkpoint is None:
            with parallel_draws():  # the large draws on every core
                fill.initialize()
        else:
            fill.read(checkpoint)
    return model.eval()


def _check_quantize(quantize) -> str | None:
    if quantize is None or quantize is False:
        return None
    if not isinstance(quantize, str) or quantize not in QUANTIZE:
        raise ValueError(f"{CALLER}: quantize must be one of {list(QUANTIZE)}, None or False, got {quantize!r}")
    return None if quantize == "none" else quantize


# -- where the files are ------------------------------------------------------------------------


def resolve(name: str, random_weights: bool) -> str:
    """The local folder of `name`: itself when it is one; a hub id's snapshot otherwise,
    downloaded when the hub answers, from the local cache when it does not."""
    if os.path.isdir(name):
        return name
    if os.path.exists(name):
        raise ValueError(
            f"{CALLER}: {name!r} is a file; pass the folder holding config.json and the .safetensors files"
        )
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"{CALLER}: no folder {name!r}")
    import huggingface_hub

    patterns = ["*.json"] if random_weights else ["*.json", "*.safetensors"]
    try:
        return huggingface_hub.snapshot_download(name, allow_patterns=patterns)
    except Exception as online:  # no network, an unknown repo, a gated one: the cache may still have it
        try:
            return huggingface_hub.snapshot_download(name, allow_patterns=patterns, local_files_only=True)
        except Exception as cached:
            raise FileNotFoundError(
                f"{CALLER}: {name!r} is not a local folder, the hub did not serve it ({type(online).__name__}: "
                f"{online}) and it is not in the local cache ({type(cached).__name__}: {cached})"
            ) from None


def read_config(folder: str, trust_remote_code: bool, overrides: dict):
    import transformers

    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"{CALLER}: no config.json in {folder}")
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    known = set(config.to_dict())
    for key, value in overrides.items():
        if key not in known and not hasattr(config, key):
            close = difflib.get_close_matches(key, sorted(known), n=3)
            raise ValueError(
                f"{CALLER}: unknown config field {key!r} for {type(config).__name__}"
                + (f" (close: {', '.join(close)})" if close else "")
            )
        setattr(config, key, value)
    return config


# -- the model, without its tensors ---------------------------------------------------------------


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter a module registers is made on the meta device (no memory, no init
    work); buffers stay real: they are small, and non-persistent ones (rotary frequencies)
    are computed by the modules' constructors, not read from checkpoints."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def build_on_meta(config, dtype: torch.dtype, trust_remote_code: bool) -> torch.nn.Module:
    import transformers

    with _parameters_on_meta():
        try:
            return transformers.AutoModelForCausalLM.from_config(
                config, dtype=dtype, trust_remote_code=trust_remote_code
            )
        except ValueError:
            if not getattr(config, "is_encoder_decoder", False):
                raise
            return transformers.AutoModelForSeq2SeqLM.from_config(
                config, dtype=dtype, trust_remote_code=trust_remote_code
            )


def _quantized_blocks(model) -> dict:
    """Each weight to store quantized -> the block of the stack holding it (its forward serves it)."""
    slots, stack = block_slots(model)
    return {s.param: stack.blocks[s.unit.block] for s in slots}


def _unique_params(model) -> list:
    return list(dict.fromkeys(model.parameters()))


def model_bytes(model, fmt: str | None, block_size: int) -> int:
    """Host bytes `model` takes loaded with `fmt` (every parameter frozen for a format)."""
    if fmt is None:
        return sum(p.numel() * p.element_size() for p in _unique_params(model))
    grads = {p: p.requires_grad for p in _unique_params(model)}
    for p in grads:
        p.requires_grad_(False)
    try:
        quantized = {s.param for s in block_slots(model)[0]}
    finally:
        for p, g in grads.items():
            p.requires_grad_(g)
    return sum(
        quantized_nbytes(p.numel(), fmt, block_size) if p in quantized else p.numel() * p.element_size() for p in grads
    )


def available_ram() -> int:
    """This process's share of the RAM available now (MemAvailable, split between the
    processes of a torchrun or Slurm job on this machine)."""
    from ...engine.placement import local_processes

    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // local_processes()
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // local_processes()


def choose_format(model, fmt: str | None, ram_fraction: float, block_size: int) -> str | None:
    """quantize='auto': the first of no quantization, int8, NF4 whose bytes fit in
    `ram_fraction` of the available RAM; DoesNotFit when none does."""
    if fmt != "auto":
        return fmt
    budget = int(ram_fraction * available_ram())
    needs = {}
    for candidate in (None, "int8", "nf4"):
        needs[candidate] = model_bytes(model, candidate, block_size)
        if needs[candidate] <= budget:
            if candidate is not None:
                log.info(
                    "load_model(quantize='auto'): %s, since %s would need %.2f GiB of the %.2f GiB allowed",
                    candidate,
                    "no quantization" if candidate == "int8" else "int8",
                    needs[{"int8": None, "nf4": "int8"}[candidate]] / GiB,
                    budget / GiB,
                )
            return candidate
    raise DoesNotFit(
        needs={"ram": needs["nf4"]},
        has={"ram": budget},
        problems=[
            f"host RAM: the model needs {needs[None] / GiB:.2f} GiB unquantized, {needs['int8'] / GiB:.2f} as int8, "
            f"{needs['nf4'] / GiB:.2f} as nf4; ram_fraction={ram_fraction} of the available RAM is "
            f"{budget / GiB:.2f} GiB"
        ],
        suggestions=["a larger ram_fraction", "more RAM", "a smaller model"],
        where="load_model()",
    )


# -- the checkpoint -------------------------------------------------------------------------------


class Checkpoint:
    """The .safetensors shards of a folder, opened for reading tensor by tensor (memory-mapped:
    a tensor is copied out only when read)."""

    def __init__(self, folder: str):
        self.folder = folder
        index = os.path.join(folder, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{CALLER}: {index} has no weight_map")
            files = sorted(set(weight_map.values()))
            for file in files:
                if not os.path.isfile(os.path.join(folder, file)):
                    raise FileNotFoundError(f"{CALLER}: {index} lists {file}, which is not in {folder}")
        else:
            files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(folder, "*.safetensors")))
            weight_map = None
            if not files:
                others = sorted(
                    os.path.basename(f)
                    for pat in ("*.bin", "*.pt", "*.pth")
                    for f in glob.glob(os.path.join(folder, pat))
                )
                if others:
                    raise ValueError(
                        f"{CALLER}: {folder} holds only PyTorch pickle files ({', '.join(others[:3])}); load_model "
                        "reads .safetensors only (convert them, e.g. with save_pretrained(safe_serialization=True))"
                    )
                raise FileNotFoundError(f"{CALLER}: no .safetensors file in {folder}")
        self.files = files
        self._weight_map = weight_map
        self._stack = contextlib.ExitStack()
        self.handles: dict = {}
        self.where: dict = {}  # tensor name -> file

    def __enter__(self):
        from safetensors import safe_open

        for file in self.files:
            handle = self._stack.enter_context(safe_open(os.path.join(self.folder, file), framework="pt"))
            self.handles[file] = handle
            for key in handle.keys():
                self.where.setdefault(key, file)
        if self._weight_map is not None:
            for key, file in self._weight_map.items():
                if self.where.get(key) != file:
                    raise ValueError(f"{CALLER}: the index lists tensor {key!r} in {file}, which does not hold it")
        return self

    def __exit__(self, *exc):
        self._stack.close()
        self.handles.clear()

    def shape(self, key: str) -> tuple:
        return tuple(self.handles[self.where[key]].get_slice(key).get_shape())

    def nbytes(self, key: str) -> int:
        sl = self.handles[self.where[key]].get_slice(key)
        sizes = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1}
        return math.prod(sl.get_shape()) * sizes.get(sl.get_dtype(), 4)

    def read(self, key: str) -> torch.Tensor:
        return self.handles[self.where[key]].get_tensor(key)


# -- filling the meta model ---------------------------------------------------------------------


class _Filler:
    """Gives each meta parameter its tensor, one at a time: read (or initialized), then either
    quantized into codes the parameter holds (`quantized`) or kept in the model's dtype. A
    parameter shared by several modules (tied embeddings) becomes one new parameter for all."""

    def __init__(self, model, quantized: dict, fmt: str | None, block_size: int):
        self.model = model
        self.quantized = quantized
        self.fmt = fmt
        self.block_size = block_size
        self.done: dict = {}  # meta parameter -> its replacement
        self.names: dict = {}  # meta parameter -> every qualified name it has
        for name, p in model.named_parameters(remove_duplicate=False):
            self.names.setdefault(p, []).append(name)

    def _slots(self):
        """(module, local name, meta parameter) of every parameter, in module order."""
        for module in self.model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    yield module, name, p

    def _place(self, module, name: str, meta, values: torch.Tensor) -> None:
        """`values` (as read or initialized) become `module`'s parameter `name`."""
        if meta in self.quantized:
            x = values if values.dtype in VALUE_DTYPES else values.to(meta.dtype)
            quantize = QuantizedWeight.quantize(x, self.fmt, self.block_size)
            q = QuantizedWeight(quantize.codes, quantize.absmax, meta.shape, meta.dtype, self.fmt, self.block_size)
            param = torch.nn.Parameter(stored.placeholder(meta.shape, meta.dtype, "cpu"), requires_grad=False)
            module._parameters[name] = param
            stored.store(module, name, q, block=self.quantized[meta])
        else:
            if values.is_floating_point() and values.dtype != meta.dtype:
                values = values.to(meta.dtype)
            param = torch.nn.Parameter(values, requires_grad=meta.requires_grad)
            module._parameters[name] = param
        self.done[meta] = param

    def _reuse(self, module, name, meta) -> bool:
        if meta in self.done:
            module._parameters[name] = self.done[meta]
            return True
        return False

    def _keys(self, meta, checkpoint):
        """The checkpoint's name for `meta` (one of _checkpoint_names of one of its names), or
        the per-expert tensors a fused expert parameter is made of (_FusedExperts); None if
        absent."""
        for name in self.names[meta]:
            for key in _checkpoint_names(self.model, name):
                if key in checkpoint.where:
                    return key
        for name in self.names[meta]:
            fused = _fused_experts(self.model, name, checkpoint)
            if fused is not None:
                return fused
        return None

    @staticmethod
    def _shape(key, checkpoint) -> tuple | None:
        return key.shape(checkpoint) if isinstance(key, _FusedExperts) else checkpoint.shape(key)

    @staticmethod
    def _sources(key) -> list[str]:
        return key.keys() if isinstance(key, _FusedExperts) else [key]

    def read(self, checkpoint: Checkpoint) -> None:
        keys, missing = {}, []
        for _, _, meta in self._slots():
            if meta not in keys:
                keys[meta] = self._keys(meta, checkpoint)
                if keys[meta] is None:
                    missing.append(self.names[meta][0])
        if missing:
            more = f" (nor {len(missing) - 1} more: {', '.join(missing[1:4])}{' ...' if len(missing) > 4 else ''})"
            per_expert = next((k for k in checkpoint.where if _PER_EXPERT.search(k)), None)
            raise ValueError(
                f"{CALLER}: the checkpoint in {checkpoint.folder} has no tensor {missing[0]!r}"
                + (more if len(missing) > 1 else "")
                + (
                    f"; it stores experts one by one ({per_expert!r}), which transformers fuses into one tensor "
                    f"per block as it loads: load_model fuses that layout for model types {sorted(_EXPERT_LAYOUTS)} "
                    f"with their own tensor names, not for model type "
                    f"{getattr(self.model.config, 'model_type', None)!r} with these"
                    if per_expert
                    else ""
                )
            )
        for meta, key in keys.items():
            shape = self._shape(key, checkpoint)
            if shape != tuple(meta.shape):
                if isinstance(key, _FusedExperts):
                    shapes = sorted({checkpoint.shape(k) for k in key.keys()})
                    what = f"the per-expert tensors {key.keys()[0]!r}, ... (shapes {shapes}) fuse into {shape}"
                else:
                    what = f"tensor {key!r} in {checkpoint.where[key]} has shape {shape}"
                raise ValueError(
                    f"{CALLER}: {what}, the model built from the config expects {tuple(meta.shape)} for "
                    f"{self.names[meta][0]}"
                )
        buffers = self._persistent_buffers(checkpoint)
        used = {k for key in keys.values() for k in self._sources(key)} | {key for _, _, key in buffers}
        aliases = {n for meta in keys for n in self.names[meta]}  # the other names of tied parameters
        unexpected = [k for k in checkpoint.where if k not in used and k not in aliases]
        if unexpected:
            log.warning(
                "load_model(): %d checkpoint tensors are not used (%s)", len(unexpected), ", ".join(unexpected[:3])
            )
        total = sum(checkpoint.nbytes(k) for k in used)
        with _progress(total) as bar:
            for module, name, meta in self._slots():
                if self._reuse(module, name, meta):
                    continue
                key = keys[meta]
                values = key.read(checkpoint) if isinstance(key, _FusedExperts) else checkpoint.read(key)
                self._place(module, name, meta, values)
                del values
                bar.update(sum(checkpoint.nbytes(k) for k in self._sources(key)))
            for module, name, key in buffers:
                values = checkpoint.read(key)
                old = module._buffers[name]
                if tuple(values.shape) != tuple(old.shape):
                    raise ValueError(
                        f"{CALLER}: tensor {key!r} in {checkpoint.where[key]} has shape {tuple(values.shape)}, the "
                        f"model's buffer expects {tuple(old.shape)}"
                    )
                module._buffers[name] = values.to(old.dtype) if values.is_floating_point() else values
                bar.update(checkpoint.nbytes(key))

    def _persistent_buffers(self, checkpoint) -> list:
        """(module, name, key) of the persistent buffers the checkpoint holds (the others keep
        what the constructor computed)."""
        found = []
        for mod_name, module in self.model.named_modules():
            for name in module._buffers:
                if module._buffers[name] is None or name in module._non_persistent_buffers_set:
                    continue
                full = f"{mod_name}.{name}" if mod_name else name
                for key in _checkpoint_names(self.model, full):
                    if key in checkpoint.where:
                        found.append((module, name, key))
                        break
        return found

    def initialize(self) -> None:
        """random_weights=True: one module at a time, its own parameters made (NaN first) and
        initialized by the model's _init_weights, then its block weights quantized. A tensor
        _init_weights leaves alone gets normal(0, initializer_range) (a 1-D weight: ones, a
        bias: zeros), never uninitialized memory."""
        std = getattr(self.model.config, "initializer_range", 0.02) or 0.02
        for module in self.model.modules():
            fresh = []
            for name, meta in list(module._parameters.items()):
                if meta is None or self._reuse(module, name, meta):
                    continue
                values = torch.full(meta.shape, float("nan"), dtype=meta.dtype)
                module._parameters[name] = torch.nn.Parameter(values, requires_grad=meta.requires_grad)
                fresh.append((name, meta))
            if not fresh:
                continue
            with torch.no_grad():
                init = getattr(self.model, "_init_weights", None)
                if init is not None:
                    init(module)
                for name, _ in fresh:
                    values = module._parameters[name].data
                    if values.is_floating_point() and _has_nan(values):
                        if values.dim() == 1:
                            values.fill_(0.0 if name.endswith("bias") else 1.0)
                        else:
                            values.normal_(0.0, std)
            for name, meta in fresh:
                self._place(module, name, meta, module._parameters[name].data)


def _has_nan(values: torch.Tensor) -> bool:
    """Whether any of `values` is NaN (initialize's mark of a value _init_weights left alone).
    amax propagates NaN: one read of the tensor, where isnan(values).any() also writes a mask
    of its size, about 10x the time on the CPU (a 14B base: some 30 s of its load)."""
    return values.numel() > 0 and bool(values.amax().isnan())


@contextlib.contextmanager
def _progress(total: int):
    """A tqdm bar over the bytes read (on a terminal, when tqdm is installed)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is None:

        class _Silent:
            def update(self, n):
                pass

        yield _Silent()
        return
    with tqdm(total=total, unit="B", unit_scale=True, desc="load_model", disable=None) as bar:
        yield bar
