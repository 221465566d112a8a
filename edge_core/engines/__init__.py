"""Each engine's rules the planner asks through :class:`edge_core.engine.EngineRules`: one module per engine.

:mod:`.vllm` holds vLLM's (its allocator emulation in :mod:`.vllm_allocator`,
its launch environment and commands in :mod:`.vllm_launch`). Pure arithmetic
and strings, no engine imported: the tier sits below ``plan/``, which asks
these rules only through the protocol a backend's ``engine_rules`` hook
answers. The package re-exports nothing: import the module.
"""
