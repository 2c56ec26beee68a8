"""The public exception types."""

from __future__ import annotations

RESOURCES = ("vram", "ram", "pinned")  # the keys of DoesNotFit.needs and .has


class DoesNotFit(MemoryError):
    """A run that cannot fit, refused before anything is moved.

    ``needs`` and ``has`` give bytes per resource ("vram": device memory before activations,
    "ram": host memory, "pinned": page-locked transfer buffers); ``problems`` says in words
    which resources fall short, ``suggestions`` what would help. The message is made from
    these fields; nothing needs to read it back."""

    def __init__(self, needs: dict, has: dict, problems: list, suggestions: list, where: str = "trainstream.wrap()"):
        self.needs = dict(needs)
        self.has = dict(has)
        self.problems = list(problems)
        self.suggestions = list(suggestions)
        self.where = where
        *rest, last = self.suggestions
        helps = f"{', '.join(rest)}{',' if len(rest) > 1 else ''} or {last}" if rest else last
        skip = " check_memory=False skips this check." if where == "trainstream.wrap()" else ""  # wrap()'s option
        super().__init__(f"{where}: this run does not fit. {'; '.join(self.problems)}. What would help: {helps}.{skip}")

    def short(self) -> list:
        """(resource, needs, has) of each resource that falls short."""
        return [(r, self.needs[r], self.has[r]) for r in RESOURCES if self.needs.get(r, 0) > self.has.get(r, 0)]

    def with_problems(self, problems: list) -> DoesNotFit:
        """The same shortfall, explained with `problems` instead."""
        return DoesNotFit(self.needs, self.has, problems, self.suggestions, self.where)

    def __reduce__(self):  # picklable with its fields (multiprocessing, torch.distributed)
        return DoesNotFit, (self.needs, self.has, self.problems, self.suggestions, self.where)
