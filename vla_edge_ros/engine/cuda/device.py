"""What both CUDA engines (engine.py: one robot; fleet.py: a batched fleet) do around their own kernels, stated once:
the device and its primary context, the compiled kernels and the limits the launch plan needs, the checkpoint read
as the kernels take it, and the teardown.

Why a base of its own: the two engines plan, allocate and launch differently, but opening the device, compiling,
applying a plan to the kernels and releasing everything (also after a failed set-up) must not drift apart.
A subclass sets ``_cuda`` (pycuda.driver), ``cfg``, ``log`` and ``weight_dtype`` before ``_open_device``.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.cuda.arch import plan_arch
from vla_edge_ros.engine.cuda.buffers import as_bf16_bits, bf16_bits_to_f32
from vla_edge_ros.engine.cuda.kernels import CompiledKernels
from vla_edge_ros.engine.cuda.plan import DeviceLimits, LaunchPlan, check_geometry


class DeviceEngine:
    """The device, its primary context and the kernels of one CUDA engine (module docstring)."""

    def _open_device(self, cfg: ModelConfig, setup: Callable[[], None]) -> None:
        """Device 0's name, build architecture and limits; the geometry refused before any work; then ``setup()``
        with the engine's primary context current (everything it allocated released if it raises)."""
        cuda = self._cuda
        dev = cuda.Device(0)
        self.device_name = dev.name()
        self.arch = plan_arch(dev.compute_capability(), os.environ.get("VLA_CUDA_ARCH", ""))
        self._sm_count = dev.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)
        self._smem_optin = dev.get_attribute(cuda.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        check_geometry(cfg, DeviceLimits(self._sm_count, self._smem_optin, self.arch.pdl))  # before any work
        self._graphs: dict[Any, Any] = {}
        self._ctx = dev.retain_primary_context()
        self._ctx.push()
        try:
            setup()
        except BaseException:
            try:
                self._release()
            finally:
                self._ctx.pop()
            raise
        self._ctx.pop()

    @contextlib.contextmanager
    def _active(self):
        """The engine's (primary) context current on the calling thread for the duration."""
        self._ctx.push()
        try:
            yield
        finally:
            self._ctx.pop()

    def _compile(self, defines: Sequence[str] = ()) -> None:
        """Every kernel file compiled and loaded; ``limits``: the device's and the compiled kernels' numbers."""
        self.kernels = CompiledKernels(self._cuda, self.arch.nvcc_arch, self.arch.target, defines, self.log)
        self.limits = DeviceLimits(self._sm_count, self._smem_optin, self.arch.pdl and self.kernels.pdl_ready,
                                   prefill_attn_regs=self.kernels.num_regs(f"attn_prefill_hd{self.cfg.head_dim}"),
                                   constants=self.kernels.constants())

    def _apply_plan(self, plan: LaunchPlan) -> None:
        """``plan`` becomes the engine's, and the kernels get what it needs: raised shared-memory limits, the
        late-trigger mask in every module."""
        self.plan = plan
        for name, nbytes in plan.raise_smem.items():
            self.kernels.raise_dynamic_smem(name, nbytes)
        self.kernels.write_u32("vla_late_trigger", plan.late_trigger_mask)

    def _load_weights(self, checkpoint) -> dict[str, Any]:
        """Tensors by name: bf16 bits, the linear weights as QuantizedLinear codes when weight_dtype is not bf16
        (quantised here from the bf16 values exactly as the numpy engine quantises them, or read pre-quantised)."""
        from vla_edge_ros.engine import quant
        from vla_edge_ros.engine.quant_checkpoint import is_quantized_checkpoint, read_quantized_checkpoint
        if not isinstance(checkpoint, Mapping) and is_quantized_checkpoint(Path(checkpoint)):
            model = read_quantized_checkpoint(checkpoint, self.weight_dtype)[1]
            return {**{k: as_bf16_bits(v) for k, v in model.dense.items()}, **model.linear}
        if isinstance(checkpoint, Mapping):
            from vla_edge_ros.engine.checkpoint import check_weights
            check_weights(self.cfg, checkpoint)
            w = {k: as_bf16_bits(v) for k, v in checkpoint.items()}
        else:
            from vla_edge_ros.engine.checkpoint import load_checkpoint
            w = load_checkpoint(checkpoint, self.cfg, dtype="bfloat16")
        if self.weight_dtype != "bf16":
            for name in [n for n in w if quant.is_quantized_name(n)]:
                w[name] = quant.quantize_linear(bf16_bits_to_f32(w[name]), self.weight_dtype)
        return w

    # ---- teardown ----------------------------------------------------------------------------------------
    def _release(self) -> None:
        for g in getattr(self, "_graphs", {}).values():
            try:
                g.destroy()
            except Exception:
                pass
        self._graphs = {}
        if getattr(self, "mem", None) is not None:
            self.mem.tracker.free_all()
        if getattr(self, "kernels", None) is not None:
            self.kernels.unload()

    def close(self) -> None:
        if getattr(self, "_ctx", None) is None:
            return
        with self._active():
            try:
                self.stream.synchronize()
            except Exception:
                pass
            self._release()
        self._ctx.detach()
        self._ctx = None

    def __del__(self):  # best effort; close() is the contract
        try:
            if getattr(self, "_ctx", None) is not None and getattr(self, "mem", None) is not None:
                self.close()
        except Exception:
            pass
