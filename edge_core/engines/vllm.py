"""vLLM's rules, as the planner asks them: :class:`~edge_core.engine.EngineRules` over the allocator and launch modules.

edge-cpu and edge-cuda hand :data:`VLLM_RULES` to the planner through the
``engine_rules`` hook (:mod:`edge_core.kit.vllm_hooks`); the planner uses them
too for a device whose backend is not installed here (a saved device list),
since every backend that plans checkpoints today runs them on vLLM. The CPU
and CUDA builds differ only where vLLM's platforms do (a bind list, visible
cards), decided by ``device.kind``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import vllm_allocator, vllm_launch

if TYPE_CHECKING:
    from ..devices import Device
    from ..engine import ChargeSettings, KVLayout, ProcessLayout
    from ..host import HostFacts
    from ..layout import Layout, NodeAddress
    from ..plans import SessionSpec


class VllmRules:
    """The :class:`~edge_core.engine.EngineRules` of vLLM (the version edge-cpu pins)."""

    name = "vllm"

    def block_size(self, layout: KVLayout, block_size: int | None, *, kv_bytes: int, cache_bytes: int,
                   ssm_bytes: int, kernel_block_tokens: int) -> int | None:
        return vllm_allocator.hybrid_block_size(layout, block_size, kv_bytes=kv_bytes, cache_bytes=cache_bytes,
                                                ssm_bytes=ssm_bytes, kernel_block_tokens=kernel_block_tokens)

    def cache_mode(self, layout: KVLayout, enable_prefix_caching: bool | None) -> str | None:
        return vllm_allocator.mamba_cache_mode(layout, enable_prefix_caching)

    def state_blocks(self, formula: str, mode: str | None) -> int:
        return vllm_allocator.state_blocks_per_request(formula, mode)

    def charge_bytes(self, layout: KVLayout, max_model_len: int, settings: ChargeSettings) -> int:
        s = settings
        return vllm_allocator.vllm_charge(
            layout, max_model_len, max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
            concurrent_batches=s.concurrent_batches, block_size=s.block_size, kv_bytes=s.kv_bytes,
            cache_bytes=s.cache_bytes, ssm_bytes=s.ssm_bytes, mamba_cache_mode=s.mamba_cache_mode)

    def charge_note(self, settings: ChargeSettings, in_flight: str, rounding: str) -> str:
        return vllm_allocator.charge_note(in_flight, rounding)

    def carve_pool(self, pool_bytes: int, *, sequence_bytes: int, block_bytes: int, max_num_seqs: int
                   ) -> tuple[int, int, int, float]:
        return vllm_allocator.carve_pool(pool_bytes, sequence_bytes=sequence_bytes, block_bytes=block_bytes,
                                         max_num_seqs=max_num_seqs)

    def engine_processes(self, device: Device, session: SessionSpec, world_size: int,
                         host: HostFacts | None) -> ProcessLayout:
        return vllm_launch.engine_processes(device, session, world_size, host)

    def launch_env(self, device: Device, layout: Layout, session: SessionSpec, host: HostFacts | None,
                   devices: list[Device]) -> tuple[dict[str, str], str | None]:
        return vllm_launch.launch_env(device, layout, session, host, devices)

    def node_env(self, device: Device, layout: Layout, hosts: list[str], facts: Mapping[str, HostFacts | None],
                 head_env: Mapping[str, str]) -> dict[str, dict[str, str]]:
        return vllm_launch.node_env(device, layout, hosts, facts, head_env)

    def node_commands(self, hosts: list[str], model: str, layout: Layout, device_files: list[str],
                      engine_kwargs: Mapping[str, Any] | None = None,
                      env_by_host: Mapping[str, Mapping[str, str]] | None = None) -> list[dict[str, Any]]:
        return vllm_launch.node_commands(hosts, model, layout, device_files, engine_kwargs, env_by_host)

    def launch_notes(self, device: Device, layout: Layout) -> tuple[str, ...]:
        return vllm_launch.launch_notes(device, layout)

    def node_address_env(self, address: NodeAddress) -> dict[str, str]:
        return vllm_launch.node_address_env(address)


#: The one instance the hooks hand out and the planner falls back to.
VLLM_RULES = VllmRules()
