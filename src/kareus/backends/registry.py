"""Backend kinds: one typed spec per kind, each validating its own options, in a registry.

The rest of Kareus never compares a backend's name: it asks a spec what it can do
(`Capabilities`) and lets it open its backend, its cost model and its plan simulator. A
new backend is one module (a `BackendSpec` subclass with a ``kind`` and its
``capabilities``, and the Backend it opens) plus one entry point (``kareus.backends``) or
`register_backend`. Specs are
plain data, so they cross process boundaries (search workers, Ray tasks) as dicts that
carry their kind.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from kareus.backends.base import Backend, CostModel, PlanSimulator
from kareus.backends.options import MAX_SEED, Flag, flag_of, option, parts
from kareus.core import MeasurementProtocol
from kareus.core.registry import Registry
from kareus.errors import SpecError
from kareus.job.spec import JobSpec
from kareus.workload.ops import Collective
from kareus.workload.workload import Workload

CollectiveFactory = Callable[[Collective, int], Callable[[], object]]
"""Real GPUs under torchrun or Ray: the group's NCCL collective of a size and SM count."""

Agree = Callable[[Any], Any]
"""Rank 0's value on every rank of a group profiled together."""


@dataclass(frozen=True)
class Capabilities:
    """What a backend kind can do; the questions code asks instead of a name."""

    real_gpu: bool = False
    """Measures real GPUs: one GPU measures one thing at a time, in this process. Its
    backend shows the device it measures (``device``, ``static_power_source``, as
    NvmlBackend): `kareus calibrate` reads its clock."""
    process_per_gpu: bool = False
    """A TP/CP group is measured by a process per GPU (torchrun or Ray actors)."""
    profiles_first: bool = False
    """`kareus optimize` profiles every number into the journal, then composes from it."""
    cost_model: bool = False
    """Offers a deterministic cost model: a search prior, and the ground truth of
    validation by whole-iteration simulation."""
    anchors: bool = False
    """Its model is the emulator's with the spec's ``calibration`` file (fitted
    parameters): `kareus calibrate` sets it next to the public anchors (docs/anchors.md)."""


@dataclass(frozen=True)
class Provenance:
    """Where a backend kind's numbers come from, as a result states it (result.json's
    ``numbers``, report.md's headline, the CLI summary)."""

    source: str
    """"gpu" (measured on a GPU), "emulator" (modelled, no GPU) or "fake-gpu" (real
    kernels timed on the CPU, energy from a fake device's counter)."""
    note: str
    """One plain sentence a reader of the numbers must see."""

    @property
    def fake(self) -> bool:
        """Numbers of a stand-in device: no measurement of any GPU, nor a model of one."""
        return self.source == "fake-gpu"


@dataclass(frozen=True)
class BackendSpec:
    """Where measurements come from and how they are taken. Subclasses add their own
    options (fields declared with kareus.backends.options.option: the CLI offers them) and
    set ``kind``, ``summary`` and ``capabilities``."""

    kind: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    """What the kind measures with, in a few words (``--backend``'s help lists them)."""
    capabilities: ClassVar[Capabilities] = Capabilities()
    provenance: ClassVar[Provenance] = Provenance(
        "unknown", "numbers of a backend that does not say where they come from")
    seed: int = option(0, flag="--seed", help="Seed of everything random.",
                       at_most=MAX_SEED)
    """Seed of everything random this backend does (and of the search)."""
    protocol: MeasurementProtocol | None = dataclasses.field(default=None, metadata=parts(
        window_s=Flag("--window", "Measurement window, s (default 5).", positive=True),
        cooldown_s=Flag("--cooldown", "Cooldown after a measurement, s (default 5)."),
        settle_s=Flag("--settle", "Settle after a clock change, s (default 2).")))
    """How one measurement is taken (window, cooldown, settle); None: the default."""

    # What a kind implements -------------------------------------------------------------

    def check(self, job: JobSpec, here: bool = True) -> None:
        """Everything that can be checked before any work starts; SpecError otherwise.
        ``here=False``: the backend opens elsewhere (a Ray rank), skip what needs it."""
        pr = self.protocol
        if pr is not None and not (math.isfinite(pr.window_s + pr.cooldown_s + pr.settle_s)
                                   and pr.window_s > 0 and pr.cooldown_s >= 0
                                   and pr.settle_s >= 0):
            raise SpecError(f"--window must be positive and --cooldown, --settle at least 0;"
                            f" got {pr.window_s}, {pr.cooldown_s}, {pr.settle_s}")

    def open(self, workload: Workload, collectives: CollectiveFactory | None = None,
             agree: Agree | None = None) -> AbstractContextManager[Backend]:
        """The backend, open for as long as the block runs (a real GPU's clocks are
        guarded that long). ``collectives``/``agree``: a group profiled together."""
        raise NotImplementedError

    def cost_model(self, job: JobSpec) -> CostModel | None:
        """A deterministic cost model of this kind, noise-free (None: it has none)."""
        return None

    def plan_simulator(self, workload: Workload) -> PlanSimulator | None:
        """Whole-iteration simulation of a plan, for validation (None: none)."""
        return None

    def power_limited_simulator(self, workload: Workload, power_limit_w: float
                                ) -> PlanSimulator | None:
        """Whole-iteration simulation with the GPUs' board power limit set to
        ``power_limit_w`` (the power-limited Megatron-LM baseline; None: none)."""
        return None

    def journal_source(self) -> tuple[str, str | None] | None:
        """(journal, backend identity or None) when plans are to be composed from that
        journal alone, with nothing searched or measured (``--measurements``)."""
        return None

    def for_rank(self, local_rank: int, device: str | None) -> BackendSpec:
        """This spec as rank ``local_rank`` of a group opens it (its own GPU)."""
        return self

    # Plain data -------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.kind

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}


S = TypeVar("S", bound=type[BackendSpec])

BACKENDS: Registry[type[BackendSpec]] = Registry(
    "backend", lambda spec: spec.kind, entry_points="kareus.backends")
"""The backend kinds by name. The kinds Kareus ships are entry points (pyproject.toml),
each imported when first asked for: each kind's module imports this one, and no backend
imports another."""


def register_backend(spec: S) -> S:
    """Add a kind (usable as a class decorator); its ``kind`` names it on the CLI."""
    if not spec.kind:
        raise ValueError(f"{spec.__name__} has no kind")
    return BACKENDS.register(spec)


def backend_kinds() -> tuple[str, ...]:
    return BACKENDS.names()


def backend_kind(name: str) -> type[BackendSpec]:
    return BACKENDS.get(name)


def numbers_from(identity: str) -> dict[str, Any]:
    """Where the numbers of a backend come from, from its identity (``<kind>:...``, as
    journals record it): ``{"backend", "source", "fake", "note"}``, the block result.json
    carries. The one place an identity is read for it."""
    kind = identity.split(":", 1)[0]
    spec = BACKENDS.find(kind)
    prov = spec.provenance if spec is not None else BackendSpec.provenance
    return {"backend": kind, "source": prov.source, "fake": prov.fake, "note": prov.note}


def cost_model_kinds() -> tuple[str, ...]:
    """Kinds that offer a cost model (a search prior, ``--fill-missing``)."""
    return tuple(k for k, s in BACKENDS.usable() if s.capabilities.cost_model)


def spec_from_options(name: str, given: dict[str, Any]) -> BackendSpec:
    """The kind ``name``'s spec from command-line options (``given``: those the user set,
    by field name). An option another kind takes is refused in one line."""
    spec = backend_kind(name)
    foreign = sorted(k for k in given if k not in _field_names(spec))
    if foreign:
        kinds = [backend_kind(k) for k in backend_kinds()]
        flags = ", ".join(next((flag_of(s, k) for s in kinds if k in _field_names(s)),
                               "--" + k.replace("_", "-")) for k in foreign)
        raise SpecError(f"{flags} does not apply to the {name} backend")
    return spec(**given)


def _field_names(spec: type[BackendSpec]) -> set[str]:
    return {f.name for f in dataclasses.fields(spec)}


def replay_spec(journal: str, identity: str | None = None, compose_only: bool = False
                ) -> BackendSpec:
    """Measurements from ``journal``; ``compose_only``: plans composed from it alone, no
    search (``--measurements``)."""
    given: dict[str, Any] = {"replay_journal": journal, "replay_identity": identity,
                             "compose_only": compose_only}
    return spec_from_options("replay", given)


def spec_from_dict(doc: dict[str, Any]) -> BackendSpec:
    """The inverse of `BackendSpec.to_dict`."""
    d = dict(doc)
    spec = backend_kind(str(d.pop("kind")))
    if d.get("protocol") is not None:
        d["protocol"] = MeasurementProtocol(**d["protocol"])
    return spec(**d)


DEFAULT_KIND = "emulator"
"""The kind a command measures with when none is named (``--backend``'s default): the
built-in emulator, which needs no GPU. It is also the model a command that never runs on
a device uses (`model_spec`), so it must offer a cost model."""


def model_spec(**given: Any) -> BackendSpec:
    """The default kind's spec, from options by field name: what measures where a command
    runs on a model, never on a device (a suite's comparison, a profile's estimate)."""
    spec = backend_kind(DEFAULT_KIND)
    if not spec.capabilities.cost_model:
        raise SpecError(f"the default backend {DEFAULT_KIND} offers no cost model")
    return spec_from_options(DEFAULT_KIND, given)


def default_spec() -> BackendSpec:
    return backend_kind(DEFAULT_KIND)()


def prior_choices() -> tuple[str, ...]:
    return ("none", *cost_model_kinds())


def open_prior(name: str | None, job: JobSpec) -> CostModel | None:
    """The search prior ``name`` ("none", or a kind with a cost model)."""
    check_prior(name)
    if name in (None, "none"):
        return None
    return backend_kind(name)().cost_model(job)


def check_prior(name: str | None) -> None:
    if name not in (None, *prior_choices()):
        raise SpecError(f"unknown prior {name!r}; available: {', '.join(prior_choices())}")
