"""Acceptance, the Day-0 doctor: one command that walks the acceptance ladder (checkpoint -> single operators -> single
layers -> single request -> batched requests -> multimodal requests -> the service) and says where a
bring-up first breaks.

- ``report.py``: ``Gate`` and ``DoctorReport`` (one line per gate, JSON).
- ``held.py``: holding DSA selections and routed experts fixed between two runs.
- ``checkpoint.py``: rung 1, validator, verified load, known answers.
- ``operators.py``: rung 2, every op on the model's shapes against its fp64 reference.
- ``layers.py``: rungs 3 and 4, cached paths against the full forward.
- ``end_to_end.py``: rungs 5 to 7, through the engine and the server.
- ``ladder.py``: ``doctor()``, the rungs in order.
"""

from .ladder import doctor
from .report import DoctorReport, Gate, Tolerance

__all__ = ["doctor", "DoctorReport", "Gate", "Tolerance"]
