"""What the doctor hands back: one ``Gate`` per rung of the acceptance ladder, and the ``DoctorReport``
that prints them one line each and serialises them for ``--json``.

A gate is PASS, FAIL or SKIP. It carries what was measured against what tolerance, why that tolerance
(a number without its reason cannot be judged), how long it took, and on a failure what to look at.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Tolerance:
    """A bound on a measured difference and the numerics that justify it."""

    value: float  # the largest difference that passes (relative to the reference's scale unless said)
    why: str  # the reason for this value, printed with the gate


@dataclass
class Gate:
    """One rung's verdict."""

    rung: int  # 1..7, the ladder's order (checkpoint, operators, layers, request, batch, multimodal, service)
    name: str  # short name of the rung, e.g. "single operators"
    status: str  # "PASS", "FAIL" or "SKIP"
    measured: str  # what was measured, with its figure, e.g. "max rel. diff 3.1e-07 over 14 op calls"
    tolerance: str = ""  # the bound ("" when the rung is exact or structural)
    why: str = ""  # the reason for the bound
    seconds: float = 0.0
    look_at: str = ""  # on FAIL: what to look at first
    details: list[str] = field(default_factory=list)  # per-item lines (each op, each layer type, ...)

    @property
    def ok(self) -> bool:
        return self.status != "FAIL"

    def line(self) -> str:
        tol = f" (tolerance {self.tolerance})" if self.tolerance else ""
        return f"[{self.status}] {self.rung}. {self.name}: {self.measured}{tol} [{self.seconds:.1f} s]"


@dataclass
class DoctorReport:
    """The ladder walked for one checkpoint, backend and device, in rung order up to the first failure."""

    checkpoint: str  # what was checked: a directory, "default" or a preset name
    backend: str
    device: str
    dtype: str
    held_choices: bool  # whether DSA keys and routed experts were held fixed in the comparisons
    gates: list[Gate] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(g.ok for g in self.gates)

    @property
    def failed(self) -> Gate | None:
        return next((g for g in self.gates if not g.ok), None)

    def __str__(self) -> str:
        held = ("DSA keys and routed experts held fixed between the compared runs (low precision flips them on "
                "near-ties)" if self.held_choices else "discrete choices free (fp32 or wider)")
        if self.dtype == "not loaded":
            held = "the model was not loaded"
        lines = [f"minidsa doctor: {self.checkpoint} on {self.device}, backend {self.backend}, {self.dtype}; {held}"]
        for g in self.gates:
            lines.append(g.line())
            lines += [f"    why this tolerance: {g.why}"] if g.why else []
            lines += [f"    {d}" for d in g.details]
        bad = self.failed
        if bad is None:
            lines.append(f"all {len(self.gates)} gates passed")
        else:
            lines.append(f"stopped at rung {bad.rung} ({bad.name}); look at: {bad.look_at}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)
