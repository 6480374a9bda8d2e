"""The policy in torch: engine/reference.py's Qwen2 decoder and patch embedder, line for line, trainable.

Why a mirror and not a new model: a checkpoint trained here is served by NumpyEngine / CudaEngine, which are
held to engine/reference.py. So this module computes what the reference computes -- RMSNorm, q/k/v with biases,
HF rotate-half RoPE with float64 angles from integer positions, grouped-query attention (query head h reads KV
head h // G), SwiGLU, the final norm and the LM head's last ``n_action_bins`` rows (tied to the embedding unless
the checkpoint has lm_head.weight), and the patch embedder ``(pixels / 255 - 0.5) @ W.T + b + pos_embed`` over
row-major 16 x 16 patches -- and its parameters carry the checkpoint's HF names exactly
(engine/checkpoint.expected_shapes + vision_shapes), so ``export_tensors`` is what write_checkpoint writes and
load_checkpoint reads back. test/test_train_model.py holds it to NumpyEngine on the same weights.

Two ways in:
- ``teacher_forced_logits`` / ``packed_logits`` (training): one causal pass over prefix + past frames + current
  frame + decode inputs per sample (train/dataset.py says why this is the runtime's context), right-padded, so
  a real token never sees a pad; the batch's sequences are assembled by index arithmetic (no per-sample loop),
  which keeps a training step on the GPU;
- ``TorchStream`` (checks, and a torch engine when one is wanted): reference_chunk's streaming chunk -- a KV
  manager decides what is retained, a frame's pre-RoPE K/V are computed once on arrival and rotated at their
  current packed position in every later chunk, greedy decode. An action chunk of H = vla.action_horizon steps
  is A = H * action_dims bins, time-major (engine/interface.py's layout; train/dataset.py's targets): with
  action_start "token" S = decode_tokens decode steps for H = 1 and max(decode_tokens, A + 1) for H > 1, bins =
  gen[1..A]; with "prefill" S = A - 1, bins = gen[0..A-1] (engine/geometry.py: the engines' arithmetic, shared).

vla.chunk_decode "parallel" (OpenVLA-OFT style, issue 22): after the same context, ONE pass over A action
slots, every slot the same input id (engine/geometry.parallel_slot_token: bin 0's id) at positions n_ctx ..
n_ctx + A - 1; the context stays causal and never sees a slot, every slot sees the whole context and all A
slots (bidirectional among them), and slot j's logits over the action rows give bin j. ``parallel_logits``
trains it (one packed pass, ``parallel_attention_mask`` by index arithmetic), ``TorchStream`` decodes it the
same way after its streamed context. No slot reads another's choice, so teacher forcing and greedy decoding are
the same pass.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vla_edge_ros.core.action_tokenizer import from_config as action_tokenizer
from vla_edge_ros.engine import geometry
from vla_edge_ros.engine.checkpoint import expected_shapes, vision_shapes
from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.vision import check_image, resize, seeded_vision_weights

INIT_STD = 0.02


# ---- building blocks (engine/reference.py names) -------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin (..., n, D) for integer positions (..., n); angles in float64 from the exact integers."""
    inv_freq = 1.0 / float(theta) ** (torch.arange(0, head_dim, 2, dtype=torch.float64,
                                                   device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, n, heads, D) rotated by (B, n, D) tables."""
    return x * cos[:, :, None, :] + rotate_half(x) * sin[:, :, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(h, h), nn.Linear(h, kv), nn.Linear(h, kv)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.H, self.KV, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def forward(self, x, cos, sin, past=None, past_cos=None, past_sin=None, mask=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.D)
        k = self.k_proj(x).view(B, T, self.KV, self.D)
        v = self.v_proj(x).view(B, T, self.KV, self.D)
        keys, values, kcos, ksin = k, v, cos, sin
        if past is not None:  # cached pre-RoPE K/V, rotated at their current positions
            keys, values = torch.cat([past[0], k], 1), torch.cat([past[1], v], 1)
            kcos, ksin = torch.cat([past_cos, cos], 1), torch.cat([past_sin, sin], 1)
        G = self.H // self.KV
        qr = apply_rope(q, cos, sin).transpose(1, 2)  # (B, H, T, D)
        kr = apply_rope(keys, kcos, ksin).repeat_interleave(G, dim=2).transpose(1, 2)  # (B, H, S + T, D)
        vr = values.repeat_interleave(G, dim=2).transpose(1, 2)
        if mask is None and past is None:
            out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.H * self.D)), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, past=None, past_cos=None, past_sin=None, mask=None):
        a, kv = self.self_attn(self.input_layernorm(x), cos, sin, past, past_cos, past_sin, mask)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Vision(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.hidden_size)
        self.pos_embed = nn.Parameter(torch.zeros(cfg.n_patches, cfg.hidden_size))


# ---- the policy ----------------------------------------------------------------------------------------------

class VLAPolicy(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.vision = Vision(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    # ---- weights
    def init_weights(self, seed: int, std: float = INIT_STD) -> "VLAPolicy":
        """Seeded init, independent of the device: norms 1, biases 0, every other tensor N(0, std)."""
        g = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if name.endswith("layernorm.weight") or name == "model.norm.weight":
                    value = torch.ones(p.shape)
                elif name.endswith(".bias"):
                    value = torch.zeros(p.shape)
                else:
                    value = torch.randn(p.shape, generator=g) * std
                p.copy_(value.to(p.device))
        return self

    def export_tensors(self) -> dict[str, np.ndarray]:
        """float32 numpy tensors by HF name: exactly the checkpoint's set (expected_shapes + vision_shapes)."""
        out = {k: v.detach().float().cpu().numpy() for k, v in self.state_dict().items()}
        want = {**expected_shapes(self.cfg), **vision_shapes(self.cfg)}
        if set(out) != set(want) or any(out[k].shape != want[k] for k in want):
            raise RuntimeError(f"torch policy tensors do not match the checkpoint layout: "
                               f"{sorted(set(out) ^ set(want))}")
        return out

    def load_tensors(self, tensors: Mapping[str, np.ndarray]) -> "VLAPolicy":
        """Load a checkpoint's tensors (engine/checkpoint.load_checkpoint) by HF name; strict."""
        if not all(n in tensors for n in vision_shapes(self.cfg)):  # the engines' seeded patch embedder then
            tensors = {**tensors, **seeded_vision_weights(self.cfg)}
        state = {k: torch.as_tensor(np.asarray(tensors[k], dtype=np.float32)) for k in self.state_dict()}
        self.load_state_dict(state, strict=True)
        return self

    # ---- pieces
    def head(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def action_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm, then the LM head's action rows: (..., hidden) -> (..., n_action_bins)."""
        return self.model.norm(h) @ self.head()[self.cfg.action_token_offset:].T

    def vision_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """(N, H, W, 3) float pixels in [0, 255] at the model's image size -> (N, n_patches, hidden)."""
        (gh, gw), p = self.cfg.patch_grid, self.cfg.patch_size
        N = pixels.shape[0]
        x = pixels.reshape(N, gh, p, gw, p, 3).permute(0, 1, 3, 2, 4, 5).reshape(N, gh * gw, p * p * 3)
        x = x * (1.0 / 255.0) - 0.5
        return self.vision.patch_embed(x) + self.vision.pos_embed

    def decoder(self, x, positions, past=None, past_positions=None, mask=None):
        """The decoder over x (B, T, hidden) at positions (B, T), after per-layer pre-RoPE ``past`` (B, S, KV, D)
        at past_positions (B, S); mask (B, 1, T, S + T) bool (None: causal, all past visible).
        -> (h (B, T, hidden) before the final norm, per layer the pre-RoPE (k, v) of x)."""
        cfg, dtype = self.cfg, x.dtype
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)
        pcos = psin = None
        if past is not None:
            pcos, psin = rope_cos_sin(past_positions, cfg.head_dim, cfg.rope_theta, dtype)
            if mask is None and x.shape[1] > 1:
                T, S = x.shape[1], past_positions.shape[1]
                causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                mask = torch.cat([torch.ones(T, S, dtype=torch.bool, device=x.device), causal], 1)[None, None]
        new_kv = []
        for i, layer in enumerate(self.model.layers):
            x, kv = layer(x, cos, sin, None if past is None else past[i], pcos, psin, mask)
            new_kv.append(kv)
        return x, new_kv

    def teacher_forced_logits(self, prefix_ids: Sequence[torch.Tensor], frames: torch.Tensor,
                              frame_counts: Sequence[int], gen_inputs: torch.Tensor) -> torch.Tensor:
        """Per sample: [prefix bytes][its frames' patch tokens, oldest -> current][gen_inputs embedded], one causal
        pass at positions 0.. (packed). -> logits (B, gen_inputs + 1, n_action_bins): row 0 from the current
        frame's last token (gen[0]), row i from decode input i - 1 (gen[i]). A list of prefixes: packed_logits."""
        dev = gen_inputs.device
        lens = torch.as_tensor([int(p.shape[0]) for p in prefix_ids], dtype=torch.long, device=dev)
        padded = torch.zeros(len(prefix_ids), max(1, int(lens.max()) if len(lens) else 1), dtype=torch.long,
                             device=dev)
        for b, ids in enumerate(prefix_ids):
            padded[b, :ids.shape[0]] = ids.to(dev)
        counts = torch.as_tensor([int(c) for c in frame_counts], dtype=torch.long, device=dev)
        return self.packed_logits(padded, lens, frames, counts, gen_inputs)

    def packed_logits(self, prefix_ids: torch.Tensor, prefix_lens: torch.Tensor, frames: torch.Tensor,
                      frame_counts: torch.Tensor, gen_inputs: torch.Tensor, context_len: int | None = None):
        """teacher_forced_logits for a whole batch by index arithmetic: prefix_ids (B, Pmax) right-padded with
        prefix_lens (B,), frames (sum F_b, H, W, 3) in sample order with frame_counts (B,), gen_inputs (B, G);
        ``context_len`` = max_b P_b + F_b * n_patches when the caller knows it (saves a device sync). Sample b's
        sequence is [P_b prefix tokens][F_b * n_patches vision tokens][G decode inputs], right-padded with zero
        rows (after every real token, so causal attention never lets a real token see one)."""
        x, pos, ctx = self._packed_sequence(prefix_ids, prefix_lens, frames, frame_counts, gen_inputs, context_len)
        B, G = gen_inputs.shape
        h, _ = self.decoder(x, pos)
        rows = ctx[:, None] - 1 + torch.arange(G + 1, device=x.device)
        return self.action_logits(h.gather(1, rows[..., None].expand(B, G + 1, h.shape[-1])))

    def parallel_logits(self, prefix_ids: torch.Tensor, prefix_lens: torch.Tensor, frames: torch.Tensor,
                        frame_counts: torch.Tensor, context_len: int | None = None) -> torch.Tensor:
        """vla.chunk_decode "parallel" (OpenVLA-OFT style) for a whole batch: packed_logits' sequence with the
        A = action_horizon * action_dims decode inputs replaced by A action slots (each the id
        geometry.parallel_slot_token, at positions n_ctx .. n_ctx + A - 1), one pass under
        ``parallel_attention_mask`` (context causal, every slot sees the context and all slots). -> logits
        (B, A, n_action_bins): row j is bin j of the chunk, time-major. The context's own last-token logits are
        not part of this layout."""
        cfg = self.cfg
        B, A = int(prefix_lens.shape[0]), geometry.chunk_action_tokens(cfg)
        slots = torch.full((B, A), geometry.parallel_slot_token(cfg), dtype=torch.long,
                           device=prefix_lens.device)
        x, pos, ctx = self._packed_sequence(prefix_ids, prefix_lens, frames, frame_counts, slots, context_len)
        h, _ = self.decoder(x, pos, mask=parallel_attention_mask(ctx, A, x.shape[1]))
        rows = ctx[:, None] + torch.arange(A, device=x.device)
        return self.action_logits(h.gather(1, rows[..., None].expand(B, A, h.shape[-1])))

    def _packed_sequence(self, prefix_ids, prefix_lens, frames, frame_counts, gen_inputs, context_len):
        """The batch's input rows (B, L, hidden), their positions (B, L) and each sample's context length (B,):
        [P_b prefix][F_b * n_patches vision][G = gen_inputs.shape[1] inputs], right-padded with zero rows."""
        cfg = self.cfg
        dev = gen_inputs.device
        B, G = gen_inputs.shape
        tpf = cfg.n_patches
        vt = self.vision_tokens(frames).reshape(-1, cfg.hidden_size)  # (sum F_b * tpf, hidden)
        ctx = prefix_lens + frame_counts * tpf  # (B,) where each sample's decode inputs start
        if context_len is None:
            context_len = int(ctx.max())
        L = int(context_len) + G
        pos = torch.arange(L, device=dev).expand(B, L)
        is_prefix = pos < prefix_lens[:, None]
        is_vision = ~is_prefix & (pos < ctx[:, None])
        gen_at = pos - ctx[:, None]
        is_gen = (gen_at >= 0) & (gen_at < G)
        tok = torch.where(is_prefix, prefix_ids.gather(1, pos.clamp(max=prefix_ids.shape[1] - 1)),
                          torch.where(is_gen, gen_inputs.gather(1, gen_at.clamp(0, G - 1)), 0))
        first_token = (torch.cumsum(frame_counts, 0) - frame_counts) * tpf  # (B,) sample's first vision token
        vis_at = (first_token[:, None] + pos - prefix_lens[:, None]).clamp(0, max(0, vt.shape[0] - 1))
        x = torch.where(is_vision[..., None], vt[vis_at], self.model.embed_tokens(tok))
        x = x * (is_prefix | is_vision | is_gen)[..., None].to(x.dtype)  # padding rows are zeros
        return x, pos, ctx


def parallel_attention_mask(ctx: torch.Tensor, n_slots: int, length: int) -> torch.Tensor:
    """(B, 1, L, L) bool, True = query row may attend key column, for sequences [ctx_b context tokens][n_slots
    action slots][padding up to L]: a context token (and a pad) sees keys up to itself (causal), so no context
    token sees a slot; a slot sees every key before the sample's end ctx_b + n_slots -- the whole context and all
    slots, later ones included -- and never a pad (pads sit after the end). Index arithmetic, no per-sample loop."""
    i = torch.arange(length, device=ctx.device)
    q, k = i[None, :, None], i[None, None, :]
    start, end = ctx[:, None, None], (ctx + n_slots)[:, None, None]
    is_slot = (q >= start) & (q < end)
    return ((k <= q) | (is_slot & (k < end)))[:, None]


# ---- the streaming chunk (engine/reference.py reference_chunk) ------------------------------------------------

class TorchStream:
    """Chunks as the runtime runs them: ``kv`` (core/kv/manager.KVManager) decides what is retained."""

    def __init__(self, policy: VLAPolicy, kv, instruction: str = "", decode_tokens: int = 8):
        cfg = policy.cfg
        ids = np.frombuffer(instruction.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        if kv.prefix_tokens != len(ids) or kv.tokens_per_frame != cfg.n_patches or decode_tokens < cfg.action_dims:
            raise ValueError(f"torch stream: the KV manager pins {kv.prefix_tokens} prefix tokens of "
                             f"{kv.tokens_per_frame} per frame; the instruction has {len(ids)} bytes, the model "
                             f"{cfg.n_patches} patches; decode_tokens={decode_tokens}")
        self.parallel = cfg.chunk_decode == "parallel"
        if self.parallel and cfg.action_start != "token":
            raise ValueError(f"torch stream: vla.chunk_decode parallel needs vla.action_start token, the "
                             f"checkpoint has {cfg.action_start!r}")
        self.policy, self.cfg, self.kv, self.decode_tokens = policy, cfg, kv, int(decode_tokens)
        # S: the engines' own rule (parallel: 1, the one pass over the A action slots)
        self.decode_steps = geometry.chunk_decode_steps(cfg, self.decode_tokens)
        self.device = next(policy.parameters()).device
        self.tokenizer = action_tokenizer(cfg)
        self.frames: dict[int, list] = {}
        with torch.no_grad():
            if len(ids):
                x = self.policy.model.embed_tokens(torch.as_tensor(ids, device=self.device))[None]
                self.prefix = self.policy.decoder(x, torch.arange(len(ids), device=self.device)[None])[1]
            else:
                z = torch.zeros(1, 0, cfg.num_key_value_heads, cfg.head_dim, device=self.device)
                self.prefix = [(z, z)] * cfg.num_hidden_layers

    @torch.no_grad()
    def encode_frame(self, image: np.ndarray) -> np.ndarray:
        """(H, W, 3) uint8 -> (n_patches, hidden) float32 vision tokens (engine/vision.py's resize)."""
        px = torch.as_tensor(resize(check_image(image), self.cfg.image_hw), device=self.device)[None]
        return self.policy.vision_tokens(px)[0].cpu().numpy()

    @staticmethod
    def _concat(segments):
        return [(torch.cat([s[i][0] for s in segments], 1), torch.cat([s[i][1] for s in segments], 1))
                for i in range(len(segments[0]))]

    @torch.no_grad()
    def run_chunk(self, tokens: np.ndarray, frame_id: int, salient: bool = False) -> dict:
        cfg, kv, pol = self.cfg, self.kv, self.policy
        tokens = np.asarray(tokens, dtype=np.float32)
        kv.admit(frame_id, tokens.mean(axis=0), salient)  # pooled embedding, as the engines pass it
        kv.take_moves()
        retained = kv.frames[:-1]
        self.frames = {f: self.frames[f] for f in retained}
        context = [self.prefix] + [self.frames[f] for f in retained]
        S = sum(seg[0][0].shape[1] for seg in context)
        n_ctx = S + tokens.shape[0]
        pos = lambda a, b: torch.arange(a, b, device=self.device)[None]  # noqa: E731
        x = torch.as_tensor(tokens, device=self.device)[None]
        h, frame_kv = pol.decoder(x, pos(S, n_ctx), self._concat(context), pos(0, S))
        self.frames[frame_id] = frame_kv
        off = cfg.action_token_offset
        logits = [pol.action_logits(h[0, -1])]
        gen = [int(logits[0].argmax()) + off]
        if self.parallel:
            return self._parallel_chunk(frame_id, self._concat(context + [frame_kv]), n_ctx, logits[0], gen[0])
        decoded = []
        for i in range(1, self.decode_steps + 1):
            e = pol.model.embed_tokens(torch.as_tensor([gen[-1]], device=self.device))[None]
            past = self._concat(context + [frame_kv] + decoded)
            h, kv_i = pol.decoder(e, pos(n_ctx + i - 1, n_ctx + i), past, pos(0, n_ctx + i - 1))
            decoded.append(kv_i)
            logits.append(pol.action_logits(h[0, -1]))
            gen.append(int(logits[-1].argmax()) + off)
        chunk_bins = geometry.chunk_bins(cfg, np.asarray(gen, np.int64))  # (H, action_dims), time-major
        return self._result(frame_id, torch.stack(logits), np.asarray(gen, np.int64), chunk_bins)

    def _parallel_chunk(self, frame_id: int, past, n_ctx: int, start_logits: torch.Tensor, gen0: int) -> dict:
        """One pass over the A action slots (VLAPolicy.parallel_logits' layout) after the context's K/V ``past``
        (n_ctx tokens at positions 0 .. n_ctx - 1): every slot sees the whole context and all slots; slot j's
        argmax is bin j, time-major. As the engines report it (engine/interface.py): gen = [gen[0] from the
        prefill (the start token, not part of the parallel training's loss), slot 0 .. slot A - 1], logits
        likewise A + 1 rows, bins = gen[1..A]. The slots' K/V are not retained (decode tokens never are)."""
        cfg, pol = self.cfg, self.policy
        A = geometry.chunk_action_tokens(cfg)
        ids = torch.full((A,), geometry.parallel_slot_token(cfg), dtype=torch.long, device=self.device)
        positions = torch.arange(n_ctx + A, device=self.device)[None]
        everything = torch.ones(1, 1, A, n_ctx + A, dtype=torch.bool, device=self.device)
        h, _ = pol.decoder(pol.model.embed_tokens(ids)[None], positions[:, n_ctx:], past, positions[:, :n_ctx],
                           mask=everything)
        logits = torch.cat([start_logits[None], pol.action_logits(h[0])])  # (A + 1, n_action_bins)
        gen = np.concatenate([[gen0], logits[1:].argmax(-1).cpu().numpy() + cfg.action_token_offset])
        gen = gen.astype(np.int64)
        return self._result(frame_id, logits, gen, geometry.chunk_bins(cfg, gen))

    def _result(self, frame_id: int, logits: torch.Tensor, token_ids: np.ndarray, chunk_bins: np.ndarray) -> dict:
        chunk = geometry.chunk_actions(self.tokenizer, chunk_bins)  # row 0 is executed first
        return {"frame_id": int(frame_id), "logits": logits.cpu().numpy(), "token_ids": token_ids,
                "action_bins": chunk_bins[0], "chunk_bins": chunk_bins, "action": chunk[0], "chunk": chunk}
