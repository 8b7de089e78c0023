"""The tensor list and metadata each architecture needs, as upstream llama.cpp (pinned commit) loads them.

Reference: src/models/{llama,qwen3,qwen3moe,qwen35,qwen35moe}.cpp (load_arch_hparams / load_arch_tensors) and
src/llama-arch.cpp for names. Each tensor carries how to fill it (`kind`) and the standard deviation of its
values: 1/sqrt(fan_in) for projections, so every matmul keeps activations near unit variance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.models import synth_blocks as sb
from app.models import synth_gguf as gg
from app.models.synth_shapes import Shape

# Projections inside blocks that --layer-scale shrinks. The router, the recurrent gates, the conv kernel and
# the norms keep their scale: shrinking them changes routing or recurrence, not the layer's output size.
_SCALED = ("attn_q.", "attn_k.", "attn_v.", "attn_output.", "attn_qkv.", "attn_gate.", "ssm_out.",
           "ffn_gate.", "ffn_up.", "ffn_down.", "ffn_gate_exps.", "ffn_up_exps.", "ffn_down_exps.",
           "ffn_gate_shexp.", "ffn_up_shexp.", "ffn_down_shexp.")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write. kind: blocks | ones | normal | ssm_a | ssm_dt | router | eh_proj."""

    name: str
    ne: tuple[int, ...]
    type: int
    kind: str
    std: float = 0.0
    layer: int = -1

    @property
    def n_values(self) -> int:
        return math.prod(self.ne)

    @property
    def n_bytes(self) -> int:
        return sb.nbytes(self.type, self.n_values)

    @property
    def layer_scaled(self) -> bool:
        return self.name.startswith("blk.") and any(p in self.name for p in _SCALED)


def _proj(name: str, ne: tuple[int, ...], qtype: int, layer: int = -1) -> TensorSpec:
    return TensorSpec(name, ne, sb.row_type(qtype, ne[0]), "blocks", 1.0 / math.sqrt(ne[0]), layer)


def _f32(name: str, ne: tuple[int, ...], kind: str, std: float = 0.0, layer: int = -1) -> TensorSpec:
    return TensorSpec(name, ne, sb.F32, kind, std, layer)


def is_recurrent(arch: str, s: Shape, il: int) -> bool:
    return arch.startswith("qwen35") and il < s.n_layer and (il + 1) % s.full_attn_interval != 0


def _attention(arch: str, s: Shape, il: int, q: int) -> list[TensorSpec]:
    p, n = f"blk.{il}.", s.n_embd
    gated = arch.startswith("qwen35")  # Qwen3.5 attention projects a sigmoid gate beside each query head
    out = [
        _proj(p + "attn_q.weight", (n, s.head_dim * s.n_head * (2 if gated else 1)), q, il),
        _proj(p + "attn_k.weight", (n, s.head_dim * s.n_head_kv), q, il),
        _proj(p + "attn_v.weight", (n, s.head_dim * s.n_head_kv), q, il),
        _proj(p + "attn_output.weight", (s.head_dim * s.n_head, n), q, il),
    ]
    if arch != "llama":
        out += [_f32(p + "attn_q_norm.weight", (s.head_dim,), "ones"),
                _f32(p + "attn_k_norm.weight", (s.head_dim,), "ones")]
    return out


def _gated_delta_net(s: Shape, il: int, q: int) -> list[TensorSpec]:
    p, n = f"blk.{il}.", s.n_embd
    key_dim, value_dim = s.ssm_state * s.ssm_groups, s.ssm_state * s.ssm_v_heads
    conv_dim = 2 * key_dim + value_dim
    return [
        _proj(p + "attn_qkv.weight", (n, conv_dim), q, il),
        _proj(p + "attn_gate.weight", (n, value_dim), q, il),
        # depthwise causal conv over ssm_conv steps: std 1/sqrt(kernel) keeps the mixed values near unit size
        _f32(p + "ssm_conv1d.weight", (s.ssm_conv, conv_dim), "normal", 1.0 / math.sqrt(s.ssm_conv)),
        _f32(p + "ssm_dt.bias", (s.ssm_v_heads,), "ssm_dt"),
        _f32(p + "ssm_a", (s.ssm_v_heads,), "ssm_a"),
        _f32(p + "ssm_beta.weight", (n, s.ssm_v_heads), "normal", 1.0 / math.sqrt(n)),
        _f32(p + "ssm_alpha.weight", (n, s.ssm_v_heads), "normal", 1.0 / math.sqrt(n)),
        _f32(p + "ssm_norm.weight", (s.ssm_state,), "ones"),
        _proj(p + "ssm_out.weight", (value_dim, n), q, il),
    ]


def _ffn(arch: str, s: Shape, il: int, q: int) -> list[TensorSpec]:
    p, n = f"blk.{il}.", s.n_embd
    if not s.is_moe:
        return [_proj(p + "ffn_gate.weight", (n, s.n_ff), q, il), _proj(p + "ffn_up.weight", (n, s.n_ff), q, il),
                _proj(p + "ffn_down.weight", (s.n_ff, n), q, il)]
    e, ffe = s.n_expert, s.n_ff_exp
    out = [
        _f32(p + "ffn_gate_inp.weight", (n, e), "router", 1.0 / math.sqrt(n), il),
        _proj(p + "ffn_gate_exps.weight", (n, ffe, e), q, il),
        _proj(p + "ffn_up_exps.weight", (n, ffe, e), q, il),
        _proj(p + "ffn_down_exps.weight", (ffe, n, e), q, il),
    ]
    if s.n_ff_shexp:
        out += [
            _f32(p + "ffn_gate_inp_shexp.weight", (n,), "normal", 1.0 / math.sqrt(n)),
            _proj(p + "ffn_gate_shexp.weight", (n, s.n_ff_shexp), q, il),
            _proj(p + "ffn_up_shexp.weight", (n, s.n_ff_shexp), q, il),
            _proj(p + "ffn_down_shexp.weight", (s.n_ff_shexp, n), q, il),
        ]
    return out


def _layer(arch: str, s: Shape, il: int, q: int) -> list[TensorSpec]:
    p, n = f"blk.{il}.", s.n_embd
    out = [_f32(p + "attn_norm.weight", (n,), "ones")]
    out += _gated_delta_net(s, il, q) if is_recurrent(arch, s, il) else _attention(arch, s, il, q)
    if arch.startswith("qwen35"):
        out.append(_f32(p + "post_attention_norm.weight", (n,), "ones"))
    else:
        out.append(_f32(p + "ffn_norm.weight", (n,), "ones"))
    return out + _ffn(arch, s, il, q)


def _mtp_layer(arch: str, s: Shape, q: int) -> list[TensorSpec]:
    # The nextn block sits after the trunk: a full-attention layer fed by eh_proj([enorm(embd); hnorm(h)]).
    il, n = s.n_layer, s.n_embd
    p = f"blk.{il}."
    return _layer(arch, s, il, q) + [
        TensorSpec(p + "nextn.eh_proj.weight", (2 * n, n), sb.F16, "eh_proj", 1.0 / math.sqrt(2 * n), il),
        _f32(p + "nextn.enorm.weight", (n,), "ones"),
        _f32(p + "nextn.hnorm.weight", (n,), "ones"),
    ]


def plan_tensors(arch: str, s: Shape, n_vocab: int, qtype: int, mtp: bool) -> list[TensorSpec]:
    """Every tensor of the model in file order."""
    n = s.n_embd
    # token_embd values have unit std: the residual stream starts at unit RMS and the layers add to it.
    out = [
        TensorSpec("token_embd.weight", (n, n_vocab), sb.row_type(qtype, n), "blocks", 1.0),
        _f32("output_norm.weight", (n,), "ones"),
        # Always a separate head: a random head tied to token_embd, under weak layers, predicts its input token.
        _proj("output.weight", (n, n_vocab), qtype),
    ]
    for il in range(s.n_layer):
        out += _layer(arch, s, il, qtype)
    if mtp:
        out += _mtp_layer(arch, s, qtype)
    return out


def plan_metadata(arch: str, s: Shape, n_vocab: int, mtp: bool) -> list[bytes]:
    """The architecture's hyper-parameter records (without general.* and tokenizer.*)."""
    a = arch + "."
    u32 = [
        ("vocab_size", n_vocab), ("context_length", s.n_ctx_train), ("embedding_length", s.n_embd),
        ("block_count", s.n_layer + (1 if mtp else 0)), ("feed_forward_length", s.n_ff),
        ("attention.head_count", s.n_head), ("attention.head_count_kv", s.n_head_kv),
        ("attention.key_length", s.head_dim), ("attention.value_length", s.head_dim),
        ("rope.dimension_count", s.rope_dims or s.head_dim),
    ]
    if s.is_moe:
        u32 += [("expert_count", s.n_expert), ("expert_used_count", s.n_expert_used),
                ("expert_feed_forward_length", s.n_ff_exp)]
        if s.n_ff_shexp:
            u32.append(("expert_shared_feed_forward_length", s.n_ff_shexp))
    if arch.startswith("qwen35"):
        u32 += [("ssm.conv_kernel", s.ssm_conv), ("ssm.inner_size", s.ssm_state * s.ssm_v_heads),
                ("ssm.state_size", s.ssm_state), ("ssm.time_step_rank", s.ssm_v_heads),
                ("ssm.group_count", s.ssm_groups), ("full_attention_interval", s.full_attn_interval)]
    if mtp:
        u32.append(("nextn_predict_layers", 1))
    out = [gg.pack_kv(a + k, v, gg.U32) for k, v in u32]
    out.append(gg.pack_kv(a + "attention.layer_norm_rms_epsilon", s.rms_eps, gg.F32))
    out.append(gg.pack_kv(a + "rope.freq_base", s.rope_base, gg.F32))
    if s.rope_sections:
        out.append(gg.pack_kv(a + "rope.dimension_sections", s.rope_sections, gg.ARR, gg.I32))
    return out
