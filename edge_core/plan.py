"""Can this checkpoint run here, on which device, with how many bytes — and if not, why.

The planner walks the candidate devices in a fixed order (private pool before
shared, then larger) through the gates: runnable, whole-session placement,
weight format, the backend's own gates (kernels, the runtime's own capacity
check), and capacity. The first device that passes every gate is selected; the
others are reported with why they were not used. A plan is returned either
way: a refusal is a value with codes, messages and remedies, never an
exception, and no remedy is ever applied silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Refusal codes. Each names the gate that said no.
REFUSAL_CODES = (
    "no_backend_installed",
    "no_runnable_device",
    "weight_format_unsupported",
    "kernel_unsupported",
    "budget_exceeds_device",
    "config_unreadable",
    "artifact_invalid",
    "no_exported_graph",
    "execution_provider_declined_graph",
    "numeric_gate_failed",
    "device_unreachable_from_this_process",
)


@dataclass(frozen=True)
class Refusal:
    """One reason a device (or the whole plan) says no, and what would change that."""

    code: str
    message: str
    remedy: str
    device_id: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.code not in REFUSAL_CODES:
            raise ValueError(f"unknown refusal code {self.code!r}; known: {', '.join(REFUSAL_CODES)}")
        if not self.message or not self.remedy:
            raise ValueError(f"refusal {self.code!r} needs both a message and a remedy")

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "device_id": self.device_id,
            "message": self.message,
            "remedy": self.remedy,
            "details": dict(self.details),
        }


@dataclass(frozen=True)
class SessionSpec:
    """The limits of one autoregressive session, as the user asked for them.

    ``max_model_len`` None means the checkpoint's own context length.
    ``kv_dtype`` is ``auto`` (the model dtype) or an fp8 variant.
    """

    max_model_len: int | None = None
    max_num_seqs: int = 1
    max_num_batched_tokens: int | None = None
    kv_dtype: str = "auto"
    enforce_eager: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "kv_dtype": self.kv_dtype,
            "enforce_eager": self.enforce_eager,
        }
