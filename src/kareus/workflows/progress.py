"""Progress of searches and profiles as bars (rich): one per partition, and one per stage
after the searches (profile's composition steps)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from kareus.search.loop import SearchResult


class ProgressBars:
    """One bar per partition on ``console``. A bar ends full when its search ends, early
    or not, and says how many settings came from the journal."""

    def __init__(self, keys: list[str], console: Console) -> None:
        self.bar = Progress(TextColumn("{task.description:<24}"), BarColumn(),
                            MofNCompleteColumn(), console=console, transient=False)
        self.ids = {k: self.bar.add_task(k, total=None) for k in keys}

    def update(self, key: str, done: int, total: int) -> None:
        if key not in self.ids:  # a stage after the searches (profile's composition steps)
            self.ids[key] = self.bar.add_task(key, total=total)
        self.bar.update(self.ids[key], completed=done, total=total)

    def log(self, message: str) -> None:
        self.bar.console.log(message)

    def finish(self, results: list[SearchResult]) -> None:
        for r in results:
            n = len(r.samples)
            reused = f" (reused {r.reused_from_journal})" if r.reused_from_journal else ""
            self.bar.update(self.ids[r.partition], completed=n, total=n,
                            description=f"{r.partition}{reused}")

    def __enter__(self) -> ProgressBars:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(None, None, None)
