"""Run a vLLM CUDA wheel's own selection functions for given SM numbers, without a GPU; print JSON.

    PYTHONPATH=<unpacked wheel> python vllm_cuda_verdicts.py 80 86 89 90 120

The wheel's compiled extensions need a driver, so they are replaced by empty
modules (they only register torch ops; nothing here calls one), and vLLM's
current platform is set to its ``CudaPlatform``. What runs is vLLM's Python:
each scheme's ``get_min_capability()``, Marlin's type query, the int8 kernel
chooser, and ``CudaPlatform.get_valid_backends`` for attention. The CUTLASS
int8 ceiling is read from the wheel's extension the way a user would see it,
as the sentence its dispatch raises. Used by test_cuda_gates_vllm.py.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import re
import sys
import types
from pathlib import Path

NATIVE = re.compile(r"^vllm\.(_C|_C_stable_libtorch|_moe_C|_moe_C_stable_libtorch|_flashmla_C|"
                    r"_flashmla_extension_C|_qutlass_C|_deepselect_C|_flashkda_C|cumem_allocator|"
                    r"fs_io_C|spinloop)$")
#: Head sizes of the reference set's and the demo's checkpoints, and MLA's (kv_lora_rank + rope dims).
HEAD_SIZES = (16, 32, 64, 72, 80, 96, 112, 128, 160, 192, 256, 512)
MLA_HEAD_SIZES = (576,)


class NativeStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self) if NATIVE.match(name) else None

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        pass


def main(sms: list[int]) -> dict:
    sys.meta_path.insert(0, NativeStub())
    import torch
    import vllm
    import vllm.platforms as platforms
    import vllm.platforms.cuda as cuda_platform
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import Int8ScaledMMLinearLayerConfig
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_fp8 import (
        CompressedTensorsW8A8Fp8,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_int8 import (
        CompressedTensorsW8A8Int8,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 import (
        CompressedTensorsWNA16,
    )
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
    from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4Config
    from vllm.model_executor.layers.quantization.utils.marlin_utils import query_marlin_supported_quant_types
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability
    from vllm.scalar_type import scalar_types
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    needs_gpu: dict[str, str] = {}
    for backend in AttentionBackendEnum:  # imported before the GPU is faked: some build objects at import
        try:
            backend.get_class()
        except Exception as exc:  # noqa: BLE001 — e.g. CUTLASS_MLA allocates a CUDA workspace when imported
            needs_gpu[backend.name] = f"{type(exc).__name__}: {exc}"
    real_class = cuda_platform._get_attn_backend_class

    def backend_class(backend):
        if backend.name in needs_gpu:  # as vLLM treats a backend that cannot be imported: not valid
            raise ImportError(needs_gpu[backend.name])
        return real_class(backend)

    cuda_platform._get_attn_backend_class = backend_class

    class GpuOfSm(CudaPlatform):
        """vLLM's CUDA platform on a GPU of one SM number: the device, faked at its boundary (no NVML)."""

        sm = 0

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(cls.sm // 10, cls.sm % 10)

    gpu = GpuOfSm()
    platforms._current_platform = gpu  # type: ignore[attr-defined]
    for module in list(sys.modules.values()):  # modules bound vllm.platforms.current_platform when imported
        if getattr(module, "__name__", "").startswith("vllm") and "current_platform" in vars(module):
            module.current_platform = gpu

    extension = Path(vllm.__file__).parent / "_C_stable_libtorch.abi3.so"
    said = re.search(rb"run on older arch \(SM < (\d+)\)", extension.read_bytes())
    ceiling = int(said.group(1)) if said else None
    int8_config = Int8ScaledMMLinearLayerConfig(is_channelwise=True, is_static_input_scheme=False,
                                                input_symmetric=True)
    out: dict = {"vllm": vllm.__version__, "int8_ceiling_message": ceiling, "sm": {},
                 "attention_backends_needing_a_gpu_to_import": sorted(needs_gpu)}
    for sm in sms:
        GpuOfSm.sm = sm
        kernel = linear.choose_scaled_mm_linear_kernel(int8_config, linear._POSSIBLE_INT8_KERNELS,
                                                       compute_capability=sm, quantization="int8_w8a8").__name__
        marlin = query_marlin_supported_quant_types(has_zp=False, device_capability=sm)
        marlin_zp = query_marlin_supported_quant_types(has_zp=True, device_capability=sm)
        int8_compiled = kernel != "CutlassInt8ScaledMMLinearKernel" or ceiling is None or sm < ceiling
        runs = {
            "dense": True,  # unquantized weights: no scheme, no minimum beyond the build's architectures
            "compressed-tensors:int8": CompressedTensorsW8A8Int8.get_min_capability() <= sm and int8_compiled,
            "compressed-tensors:fp8": CompressedTensorsW8A8Fp8.get_min_capability() <= sm,
            "fp8": CompressedTensorsW8A8Fp8.get_min_capability() <= sm,
            "compressed-tensors:w4a16": CompressedTensorsWNA16.get_min_capability() <= sm
            and scalar_types.uint4b8 in marlin,
            "gptq": AutoGPTQConfig.get_min_capability() <= sm and scalar_types.uint4b8 in marlin,
            "awq": AutoAWQConfig.get_min_capability() <= sm and scalar_types.uint4 in marlin_zp,
            "mxfp4": Mxfp4Config.get_min_capability() <= sm,
            "modelopt_fp4": ModelOptNvFp4Config.get_min_capability() <= sm,
            "bitsandbytes": "bitsandbytes" in QUANTIZATION_METHODS,
        }
        capability = DeviceCapability(sm // 10, sm % 10)
        attention = {}
        with set_current_vllm_config(VllmConfig()):  # some backends read the engine's config while judging
            for mla, sizes in ((False, HEAD_SIZES), (True, MLA_HEAD_SIZES)):
                for size in sizes:
                    config = AttentionSelectorConfig(head_size=size, dtype=torch.bfloat16, kv_cache_dtype="auto",
                                                     block_size=None, use_mla=mla)
                    valid, _ = CudaPlatform.get_valid_backends(capability, config)
                    attention[f"{'mla' if mla else 'mha'}:{size}"] = [v.backend.name for v in valid]
        out["sm"][str(sm)] = {"int8_kernel": kernel, "runs": runs, "attention": attention}
    return out


if __name__ == "__main__":
    print(json.dumps(main([int(a) for a in sys.argv[1:]])))
