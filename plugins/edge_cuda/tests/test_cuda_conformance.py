"""edge-cuda against edge-core's conformance suite.

Without the hardware (or its runtime) the probe reports no runnable device and
the checks that need one skip themselves, saying why; the contract, probe and
planning checks run everywhere.
"""

from __future__ import annotations

import pytest

from edge_core.testing import BackendConformance

edge_cuda = pytest.importorskip("edge_cuda", reason="edge-cuda is not installed and its source is not beside these tests")


class TestCudaConformance(BackendConformance):
    plugin = edge_cuda
    plugin_name = "cuda"


class TestCudaConformanceWithFakeGpus(BackendConformance):
    """The same checks with two GPUs seen through a fake NVML, so the device checks are not vacuous here.

    Only the ``pynvml`` module is replaced (the fake from test_cuda_probe.py); the
    probe code runs unchanged. No CUDA build of vLLM is installed on a CPU
    machine, so the GPUs are listed as not runnable, with the reason.
    """

    plugin = edge_cuda
    plugin_name = "cuda"

    @pytest.fixture(autouse=True)
    def _fake_nvml(self, monkeypatch):
        import sys

        from test_cuda_probe import FakeGPU, fake_nvml

        gib = 1 << 30
        gpus = [FakeGPU("NVIDIA GeForce RTX 5090 Laptop GPU", (12, 0), 24 * gib, 22 * gib, "GPU-5090"),
                FakeGPU("NVIDIA H100 80GB HBM3", (9, 0), 80 * gib, 79 * gib, "GPU-H100")]
        monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(gpus))

    def test_the_fake_gpus_are_probed(self, registry):
        devices = self._probe(registry, self._host())
        assert [d.device_id for d in devices] == ["cuda:0", "cuda:1"]
