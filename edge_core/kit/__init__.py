"""The backend kit: code a backend may use to implement the hooks, shared so two backends write it once.

:mod:`.vllm_hooks` implements the stage and server hooks on vLLM (edge-cpu and
edge-cuda), :mod:`.ort_hooks` the stage hooks on ONNX Runtime (edge-dml and
edge-vitisai), :mod:`.vllm_source` reads the installed vLLM's registry and
tables from its source. The kit sits on top of the layers: it calls into the
runtime when a hook runs, and nothing in the core imports it. The package
re-exports nothing: import the module. :mod:`edge_core.testing` is the kit's
test half (the conformance suite).
"""
