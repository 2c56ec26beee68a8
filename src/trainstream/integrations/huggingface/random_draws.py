"""Random initialization of a large model on every core, with values that depend on the seed
alone.

torch's CPU generator draws one value after another on one thread (about 5-10 ns a value), so
a random 14B base spends minutes in ``normal_`` alone. Inside ``parallel_draws()``, a
``normal_`` or ``uniform_`` (the tensor method or ``torch.nn.init``'s, which transformers'
``_init_weights`` calls) on a contiguous CPU tensor of at least ``2 * CHUNK`` values, with no
generator of the caller's, is split into chunks of CHUNK values. Each chunk is drawn from a
generator of its own, seeded by (the context's seed, the draw's number, the chunk's number),
on a pool of torch's intra-op thread count (the ops release the GIL). Chunks are fixed, so
the values do not depend on how many threads drew them; the distribution is the one asked for,
only the stream differs from one generator's. Every other call runs as it would.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib

import torch
from torch.overrides import TorchFunctionMode

CHUNK = 1 << 22  # values per generator: about 40 ms of one thread's draws


def _chunk_seed(seed: int, draw: int, chunk: int) -> int:
    """A 63-bit seed for one chunk, mixed from the three numbers (neighbouring chunks get
    unrelated seeds, not consecutive ones)."""
    digest = hashlib.blake2b(f"{seed}:{draw}:{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _ParallelDraws(TorchFunctionMode):
    """The mode behind parallel_draws(): see the module's docstring."""

    # func -> (the tensor method each chunk calls, the names of its two arguments, their defaults)
    DRAWS = {
        torch.Tensor.normal_: ("normal_", ("mean", "std"), (0.0, 1.0)),
        torch.nn.init.normal_: ("normal_", ("mean", "std"), (0.0, 1.0)),
        torch.Tensor.uniform_: ("uniform_", ("from", "to"), (0.0, 1.0)),
        torch.nn.init.uniform_: ("uniform_", ("a", "b"), (0.0, 1.0)),
    }

    def __init__(self, seed: int, pool: concurrent.futures.Executor):
        super().__init__()
        self.seed = seed
        self.pool = pool
        self.draws = 0  # draws split so far: each one's number goes into its chunks' seeds

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spec = self.DRAWS.get(func)
        if spec is not None:
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if self._splittable(tensor, kwargs):
                return self._draw(tensor, spec, args[1:], kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _splittable(tensor, kwargs) -> bool:
        return (
            isinstance(tensor, torch.Tensor)
            and kwargs.get("generator") is None
            and not (tensor.requires_grad and torch.is_grad_enabled())  # autograd's checks and graph: torch's
            and tensor.device.type == "cpu"
            and tensor.is_floating_point()
            and tensor.is_contiguous()
            and tensor.numel() >= 2 * CHUNK
        )

    def _draw(self, tensor: torch.Tensor, spec, positional, kwargs) -> torch.Tensor:
        method, names, defaults = spec
        low_high = [kwargs.get(n, d) for n, d in zip(names, defaults)]
        low_high[: len(positional)] = positional[:2]
        draw, self.draws = self.draws, self.draws + 1
        flat = tensor.detach().view(-1)

        def one(chunk: int) -> None:
            g = torch.Generator().manual_seed(_chunk_seed(self.seed, draw, chunk))
            getattr(flat[chunk * CHUNK : (chunk + 1) * CHUNK], method)(*low_high, generator=g)

        with torch.no_grad():
            list(self.pool.map(one, range(-(-flat.numel() // CHUNK))))
        return tensor


@contextlib.contextmanager
def parallel_draws():
    """Large CPU normal_/uniform_ draws inside the block run on every core (module docstring).
    The context's seed is drawn from torch's default generator, so ``torch.manual_seed``
    before it fixes every value drawn inside."""
    seed = int(torch.randint(0, 2**62, (1,)).item())
    workers = max(1, torch.get_num_threads())
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="trainstream-draws") as pool:
        with _ParallelDraws(seed, pool):
            yield
