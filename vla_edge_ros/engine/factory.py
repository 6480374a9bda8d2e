"""make_engine: parameters -> a ready engine (backend chosen, checkpoint loaded, KV manager built, prefix prefilled).

Backend choice (``backend`` parameter):
  numpy  the CPU reference backend;
  cuda   the PyCUDA backend; an EngineError when it cannot run here (no PyCUDA, no GPU);
  auto   cuda when ``vla_edge_ros.engine.cuda_backend.cuda_available()`` says so, else numpy; the choice and
         the reason are logged.

The CUDA backend is expected to provide ``cuda_available() -> bool`` (optionally ``cuda_unavailable_reason()
-> str``) and ``CudaEngine(cfg, checkpoint_dir, kv, instruction=..., decode_tokens=..., max_vram_gb=...,
log=...)``; it loads its own weights (bf16 straight to the device).

Weights (``weight_dtype``, issue 23, docs/QUANTIZATION.md): a plain checkpoint is quantised at load to int8 / fp8 /
int4; a pre-quantised one (engine/quant_checkpoint.py) is read as it is and must be in ``weight_dtype`` (refused by
name otherwise, before either backend loads anything). The CUDA backend refuses anything but bf16 for now
(engine/cuda/engine.unsupported_reason).

With the environment variable ``VLA_FAULT_INJECT`` set, the engine is wrapped by
``engine.fault_injection.FaultInjectingEngine`` (reliability tests only).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from vla_edge_ros import params as P
from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.geometry import (check_decode_tokens, check_positions, check_tokens_per_frame,
                                          chunk_scratch_slots, describe_decode_steps, prefix_token_ids)
from vla_edge_ros.engine.interface import Engine, EngineError

ENGINE_PARAMS = ("checkpoint", "backend", "instruction", "tokens_per_frame", "decode_tokens", "kv_budget_tokens",
                 "eviction_policy", "window_frames", "max_vram_gb", "weight_dtype", "action_readout")


def _cuda_probe() -> tuple[Any, str]:
    """(cuda_backend module or None, reason when None)."""
    try:
        from vla_edge_ros.engine import cuda_backend
    except ImportError as exc:
        return None, f"cuda backend not importable ({exc})"
    try:
        ok = bool(cuda_backend.cuda_available())
    except Exception as exc:  # a broken driver must not take the CPU path down with it
        return None, f"CUDA probe failed ({type(exc).__name__}: {exc})"
    if not ok:
        why = getattr(cuda_backend, "cuda_unavailable_reason", None)
        return None, why() if callable(why) else "no usable CUDA GPU / PyCUDA"
    return cuda_backend, ""


def resolve_checkpoint(checkpoint: str) -> Path:
    if checkpoint:
        from vla_edge_ros.engine import shipped
        try:
            return shipped.resolve(checkpoint)  # a path, or the name of a policy shipped in the package
        except shipped.ShippedPolicyError as exc:
            raise EngineError(str(exc)) from exc
    from vla_edge_ros.engine.tiny_default import ensure_tiny_default
    return ensure_tiny_default()


def make_engine(params: Mapping[str, Any], log: Callable[[str], None] = print) -> Engine:
    """Build the engine from (a subset of) the ROS parameters; missing ones take their registry defaults."""
    values = {name: params[name] for name in ENGINE_PARAMS if name in params}
    v = {**{name: P.BY_NAME[name].default for name in ENGINE_PARAMS}, **values}
    instruction = v["instruction"]
    if not isinstance(instruction, str):
        raise EngineError(f"instruction must be a string, got {type(instruction).__name__}")
    prefix_tokens = len(prefix_token_ids(instruction))
    reasons = P.validate_all(v, prefix_tokens=prefix_tokens)
    if reasons:
        raise EngineError("invalid engine parameters: " + "; ".join(reasons))

    ckpt = resolve_checkpoint(v["checkpoint"])
    cfg = ModelConfig.from_json(ckpt)
    tpf, dec = v["tokens_per_frame"], v["decode_tokens"]
    # the parameters against the model before anything is loaded (the backends check what they are handed again)
    check_tokens_per_frame(cfg, tpf)
    check_decode_tokens(cfg, dec)
    weight_dtype = v["weight_dtype"]
    prequantized = _check_prequantized(ckpt, weight_dtype)

    backend, cuda_mod = v["backend"], None
    if backend in ("auto", "cuda"):
        cuda_mod, why = _cuda_probe()
        if cuda_mod is None and backend == "cuda":
            raise EngineError(f"backend=cuda requested but CUDA is not usable here: {why}. "
                              "Use backend:=numpy or backend:=auto")
        if cuda_mod is None:
            log(f"engine: backend=numpy (auto: {why}), checkpoint {ckpt}")
    chosen = "cuda" if cuda_mod is not None else "numpy"
    budget = P.resolve_kv_budget(v["kv_budget_tokens"], chosen, tpf)
    check_positions(cfg, budget, dec)  # for the chunk's decode tokens (geometry.chunk_scratch_slots)
    if cfg.action_start != "token" or cfg.action_horizon > 1 or cfg.chunk_decode != "autoregressive":
        log(f"engine: vla.action_start={cfg.action_start}, vla.action_horizon={cfg.action_horizon}, vla.chunk_decode="
            f"{cfg.chunk_decode}: 1 prefill + {describe_decode_steps(cfg, dec)} per chunk "
            f"({chunk_scratch_slots(cfg, dec)} scratch slots)")

    from vla_edge_ros.core.kv.manager import KVManager
    try:
        kv = KVManager(budget, tpf, prefix_tokens, policy=v["eviction_policy"], window_frames=v["window_frames"],
                       embed_dim=cfg.hidden_size)
    except ValueError as exc:
        raise EngineError(f"KV manager: {exc}") from exc
    if not v["kv_budget_tokens"]:
        log(f"engine: kv_budget_tokens {budget} ({chosen} default; set kv_budget_tokens to override)")

    if cuda_mod is not None:
        log(f"engine: backend=cuda (requested {backend}), checkpoint {ckpt}")
        return _wrap_faults(cuda_mod.CudaEngine(cfg, ckpt, kv, instruction=instruction, decode_tokens=dec,
                                                max_vram_gb=v["max_vram_gb"], log=log, weight_dtype=weight_dtype,
                                                action_readout=v["action_readout"]),
                            log)
    if backend == "numpy":
        log(f"engine: backend=numpy, checkpoint {ckpt}")

    from vla_edge_ros.engine.checkpoint import load_checkpoint
    from vla_edge_ros.engine.numpy_backend import NumpyEngine
    if prequantized:
        from vla_edge_ros.engine.quant_checkpoint import read_quantized_checkpoint
        weights = read_quantized_checkpoint(ckpt, weight_dtype)[1]
    else:
        weights = load_checkpoint(ckpt, cfg)
    engine = NumpyEngine(cfg, weights, kv, instruction=instruction, decode_tokens=dec, weight_dtype=weight_dtype,
                         action_readout=v["action_readout"])
    del weights
    if weight_dtype != "bf16":
        how = "pre-quantised checkpoint" if prequantized else "quantised at load"
        log(f"engine: weight_dtype {weight_dtype} ({how}): {engine.device_weight_bytes / 2**20:.1f} MiB of weights "
            "as a GPU would hold them; the numpy engine computes with float32 dequantised copies")
    return _wrap_faults(engine, log)


def _check_prequantized(ckpt: Path, weight_dtype: str) -> bool:
    """Whether ``ckpt`` is pre-quantised; one in another weight_dtype than configured is refused by name."""
    from vla_edge_ros.engine.quant_checkpoint import is_quantized_checkpoint, read_quantization_block
    if not is_quantized_checkpoint(ckpt):
        return False
    stored = read_quantization_block(ckpt)["weight_dtype"]  # QuantCheckpointError (an EngineError) if malformed
    if stored != weight_dtype:
        raise EngineError(f"checkpoint {ckpt} is pre-quantised as {stored} but weight_dtype={weight_dtype!r}: set "
                          f"weight_dtype:={stored}, or point checkpoint at the bf16 model to quantise it at load")
    return True


def _wrap_faults(engine: Engine, log: Callable[[str], None]) -> Engine:
    """Wrap in the fault injector when VLA_FAULT_INJECT is set (reliability tests only; it logs loudly)."""
    from vla_edge_ros.engine.fault_injection import wrap_from_env
    try:
        return wrap_from_env(engine, log=log)
    except ValueError as exc:
        engine.close()
        raise EngineError(str(exc)) from exc

