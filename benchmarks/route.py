"""How often the job climbs back up the layers on its way through one command.

Follows the job through the calls of one in-process `kareus optimize` (or `profile`):
every call of a Kareus function that receives the job or an object built from it (a
JobSpec, Workload, PartitionSet or ExecutionGraph, or the OptimizeRequest that carries
it) as a parameter (not as ``self``: a
method of those objects uses the job where it is) is a step of the route, at the layer of
the function's module (the layers contract in pyproject.toml, top first). Consecutive steps
in one layer are one stop. A climb is a stop in a higher layer than the stop before it:
the route went down to derive something and came back up for the next thing. Also counts
how often the route enters the partition module.

    python benchmarks/route.py                     # this checkout
    python benchmarks/route.py --command profile
    python benchmarks/route.py --write-doc         # docs/architecture.md's figures, rewritten
    PYTHONPATH=/path/to/other/src python benchmarks/route.py   # another one, same job

tests/test_route.py runs `measure` for both commands and holds each to
`ROUTE_BUDGET` climbs.

The job is small (kareus-1 at two clocks, four microbatches, 20 samples per partition,
searches in this process) so that the trace takes a few seconds; the route's shape does
not depend on the budget.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import itertools
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

# The top-level layers, top first (the layers contract in pyproject.toml); a flat module of
# an older layout maps to its package.
LAYERS = ["cli", "workflows", "profiling", "integrations", "results",
          "compose|search|runtime", "backends", "gpu|store", "plans", "workload", "job",
          "ray_support", "core", "errors"]
FLAT = {"compare": "workflows", "sensitivity": "workflows", "optimize": "workflows",
        "perseus": "workflows", "profile_ray": "workflows", "profile": "workflows",
        "executors": "workflows", "resultdir": "results", "report": "results",
        "result": "results", "export": "plans", "metrics": "plans", "plan": "plans",
        "methods": "plans", "execution": "plans", "schedule": "plans",
        "partition": "workload", "memory": "workload", "sources": "job", "presets": "job",
        "spec": "job", "hardware": "job", "atomic": "core", "jsonfile": "core",
        "pareto": "core"}
TRACKED = ("JobSpec", "Workload", "PartitionSet", "ExecutionGraph", "OptimizeRequest")
COMMANDS = ("optimize", "profile")
ROUTE_BUDGET = 10
"""At most this many climbs per command (issue 40; tests/test_route.py)."""
DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"
BEGIN, END = "<!-- route.py --write-doc: begin -->", "<!-- route.py --write-doc: end -->"


RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "kareus" or len(parts) < 2:
        return None
    top = FLAT.get(parts[1], parts[1])
    for i, row in enumerate(LAYERS):
        if top in row.split("|"):
            return i
    return None


def follow(run: Callable[[], object]) -> tuple[list[int], int]:
    """The layers of the calls that carry the job while ``run`` runs, and the entries into
    the partition module."""
    steps: list[int] = []
    partition_entries = 0
    # a generator (a context manager's body, say) reports "call" each time it resumes:
    # only its first entry is a call; the frames are kept so that their ids stay unique
    started: dict[int, object] = {}

    def hook(frame, event, _arg):  # type: ignore[no-untyped-def]
        nonlocal partition_entries
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        layer = layer_of(module)
        if layer is None:
            return
        code = frame.f_code
        if code.co_flags & RESUMABLE:
            if id(frame) in started:
                return
            started[id(frame)] = frame
        n = code.co_argcount + code.co_kwonlyargcount
        # the job handed on as a parameter; a method of the job's own objects (``self``)
        # uses it where it is, it does not carry it anywhere
        args = (frame.f_locals.get(v) for v in code.co_varnames[:n]
                if v not in ("self", "cls"))
        if any(type(a).__name__ in TRACKED for a in args):
            steps.append(layer)
            caller = frame.f_back
            if (module.endswith("partition") and caller is not None
                    and caller.f_globals.get("__name__") != module):
                partition_entries += 1

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        run()
    except SystemExit:
        pass
    finally:
        sys.setprofile(previous)
    return steps, partition_entries


def trace(argv: list[str]) -> tuple[list[int], int]:
    from kareus.cli import main

    return follow(lambda: main(argv))


def climbs(steps: list[int]) -> tuple[list[int], int]:
    stops = [s for i, s in enumerate(steps) if i == 0 or s != steps[i - 1]]
    return stops, sum(1 for a, b in itertools.pairwise(stops) if b < a)


def measure(command: str) -> tuple[int, list[int], int, int]:
    """One in-process ``command`` (optimize or profile) on the small job: (calls carrying
    the job, the stops (their layers, in order), climbs, entries into the partition
    module)."""
    if command not in COMMANDS:
        raise ValueError(f"command takes {' or '.join(COMMANDS)}, got {command!r}")
    job = ["-p", "kareus-1", "--freqs", "1410,1200", "--microbatches", "4"]
    with tempfile.TemporaryDirectory() as tmp:
        if command == "optimize":
            argv = ["optimize", *job, "--budget", "20", "--workers", "1", "--out",
                    str(Path(tmp) / "o"), "--json"]
        else:
            argv = ["profile", *job, "--backend", "emulator", "--budget", "20",
                    "--journal", str(Path(tmp) / "j.sqlite"), "--json"]
        with contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            steps, entries = trace(argv)
    stops, n = climbs(steps)
    return len(steps), stops, n, entries


def doc_block(figures: dict[str, tuple[int, list[int], int, int]]) -> str:
    """docs/architecture.md's figures, as `--write-doc` writes them."""
    rows = [f"| {c} | {calls} | {len(stops)} | {n} | {entries} |"
            for c, (calls, stops, n, entries) in figures.items()]
    return "\n".join([BEGIN, "| command | calls carrying the job | stops | climbs "
                      f"(budget {ROUTE_BUDGET}) | entries into partition.py |",
                      "|---|---|---|---|---|", *rows, END])


def write_doc(figures: dict[str, tuple[int, list[int], int, int]], doc: Path = DOC) -> None:
    """Replace the figures between the markers in ``doc`` with these."""
    text = doc.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{doc}: no block between {BEGIN} and {END}")
    doc.write_text(pattern.sub(lambda _m: doc_block(figures), text))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--command", default="optimize", choices=COMMANDS)
    ap.add_argument("--write-doc", action="store_true",
                    help="measure both commands and rewrite docs/architecture.md's figures")
    args = ap.parse_args()
    import kareus

    print(f"kareus at {Path(kareus.__file__).parent}")
    commands = COMMANDS if args.write_doc else (args.command,)
    figures = {c: measure(c) for c in commands}
    for command, (calls, stops, n, entries) in figures.items():
        print(f"{command}: {calls} calls carry the job; {len(stops)} stops; "
              f"{n} climbs back up a layer (budget {ROUTE_BUDGET}); the partition module "
              f"entered {entries} times")
        print("stops per layer: " + ", ".join(
            f"{LAYERS[k]} {v}" for k, v in sorted(Counter(stops).items())))
    if args.write_doc:
        write_doc(figures)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
