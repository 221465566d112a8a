"""Run it: an admitted plan becomes a running stage, its memory sampled, cancelled and stopped cleanly.

The runtime layer. vLLM and ONNX Runtime are imported inside functions only,
when a stage starts. The package re-exports nothing: each command imports the
module that runs it, so ``edge plan`` admits through :mod:`.admission` without
loading psutil or the rest. Every engine start
goes through :class:`.session.StageSession`: ``edge run`` is
:func:`.session.run_session`, ``edge serve`` :func:`.serve.serve_plan`, ``edge accept``
:func:`.accept.run_acceptance`, ``edge parity`` :func:`.parity.run_parity`; a graph stage,
which runs in this process, :func:`.graph_run.run_graph_stage`.

Modules: :mod:`.admission` (which plan a command runs, admitted on this
host), :mod:`.session`, :mod:`.accept`, :mod:`.parity`, :mod:`.graph_run`
(what a command runs); :mod:`.vllm_stage`, :mod:`.ort_stage` (the two stage
runtimes backends share); :mod:`.env` (the engine's environment),
:mod:`.numa` (NUMA node preparation), :mod:`.stream_run` and
:mod:`.stream_queue` (one request driven through a bounded stream),
:mod:`.processes` (process groups and reaping), :mod:`.reaper` (each
session's marker, and the reaper that ends its engine processes when edge is
killed), :mod:`.measure` (the process-tree memory sampler), :mod:`.documents`
(the envelope every JSON document edge writes starts with).
"""
