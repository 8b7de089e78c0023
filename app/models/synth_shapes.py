"""Model shapes for the synthetic writer: the hyper-parameters of each architecture and size we can write.

The real-size rows follow the published configurations of the models they are named after (Llama 3.x, Qwen3,
Qwen3-MoE, Qwen3.5 hybrid dense and MoE); the Qwen3.5 rows are approximate where public configs were not at hand.
`tiny` rows are ours: a few MB, two to four layers, for CPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# Architectures we write. qwen35/qwen35moe are the hybrid (gated delta net + full attention every 4th layer)
# families; upstream can also load their MTP (nextn) block, which llama/qwen3/qwen3moe do not have.
ARCHS = ("llama", "qwen3", "qwen3moe", "qwen35", "qwen35moe")
MTP_ARCHS = ("qwen35", "qwen35moe")
DEFAULT_VOCAB = {
    "llama": "llama-bpe",
    "qwen3": "qwen2",
    "qwen3moe": "qwen2",
    "qwen35": "qwen35",
    "qwen35moe": "qwen35",
}


@dataclass(frozen=True)
class Shape:
    """Hyper-parameters of one model; every size the tensor plan needs is derived from these."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int  # dense FFN width (for MoE: also written as feed_forward_length, as the converters do)
    n_ctx_train: int = 32768
    rope_base: float = 10000.0
    rms_eps: float = 1e-6
    # mixture of experts
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    # hybrid (gated delta net) layers
    ssm_conv: int = 4
    ssm_state: int = 0  # head dim of both keys and values in the recurrent layers
    ssm_groups: int = 0  # key heads
    ssm_v_heads: int = 0  # value heads (time_step_rank)
    full_attn_interval: int = 4
    rope_dims: int = 0  # 0: the whole head
    rope_sections: tuple[int, ...] = field(default=())

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0


def _dense(n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, **kw) -> Shape:
    return Shape(n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_ff=n_ff, **kw)


def _hybrid(n_embd, n_layer, n_head, n_head_kv, n_ff, v_heads, k_heads=16, state=128, head_dim=256, **kw) -> Shape:
    # Qwen3.5: attention heads of 256 with a quarter of each rotated; the rotated pairs split into m-rope sections.
    rope_dims = head_dim // 4
    half = rope_dims // 2
    sections = (half - 2 * (half // 3), half // 3, half // 3, 0)
    return _dense(n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, ssm_state=state, ssm_groups=k_heads,
                  ssm_v_heads=v_heads, rope_dims=rope_dims, rope_sections=sections, rope_base=1e7,
                  n_ctx_train=262144, **kw)


_LLAMA = dict(rope_base=500000.0, rms_eps=1e-5, n_ctx_train=131072)
_QWEN3 = dict(rope_base=1e6, n_ctx_train=40960)

SHAPES: dict[str, dict[str, Shape]] = {
    "llama": {
        "tiny": _dense(64, 2, 4, 2, 16, 128, rope_base=500000.0, rms_eps=1e-5),
        "1b": _dense(2048, 16, 32, 8, 64, 8192, **_LLAMA),
        "3b": _dense(3072, 28, 24, 8, 128, 8192, **_LLAMA),
        "8b": _dense(4096, 32, 32, 8, 128, 14336, **_LLAMA),
        "70b": _dense(8192, 80, 64, 8, 128, 28672, **_LLAMA),
    },
    "qwen3": {
        "tiny": _dense(64, 2, 4, 2, 16, 128, rope_base=1e6),
        "0.6b": _dense(1024, 28, 16, 8, 128, 3072, **_QWEN3),
        "1.7b": _dense(2048, 28, 16, 8, 128, 6144, **_QWEN3),
        "4b": _dense(2560, 36, 32, 8, 128, 9728, **_QWEN3),
        "8b": _dense(4096, 36, 32, 8, 128, 12288, **_QWEN3),
        "14b": _dense(5120, 40, 40, 8, 128, 17408, **_QWEN3),
        "32b": _dense(5120, 64, 64, 8, 128, 25600, **_QWEN3),
    },
    "qwen3moe": {
        "tiny": _dense(64, 2, 4, 2, 16, 128, rope_base=1e6, n_expert=16, n_expert_used=4, n_ff_exp=64),
        "30b-a3b": _dense(2048, 48, 32, 4, 128, 6144, n_expert=128, n_expert_used=8, n_ff_exp=768, **_QWEN3),
        "235b-a22b": _dense(4096, 94, 64, 4, 128, 12288, n_expert=128, n_expert_used=8, n_ff_exp=1536, **_QWEN3),
    },
    "qwen35": {
        "tiny": _hybrid(64, 4, 2, 1, 128, v_heads=4, k_heads=2, state=32, head_dim=32, full_attn_interval=4),
        "0.8b": _hybrid(1024, 24, 8, 2, 3584, v_heads=16),
        "2b": _hybrid(2048, 24, 8, 2, 6144, v_heads=16),
        "4b": _hybrid(2560, 32, 16, 4, 9216, v_heads=32),
        "9b": _hybrid(4096, 32, 16, 4, 12288, v_heads=32),
        "27b": _hybrid(5120, 64, 24, 4, 17408, v_heads=48),
    },
    "qwen35moe": {
        "tiny": _hybrid(64, 4, 2, 1, 128, v_heads=4, k_heads=2, state=32, head_dim=32,
                        n_expert=16, n_expert_used=4, n_ff_exp=64, n_ff_shexp=64),
        "35b-a3b": _hybrid(2048, 40, 16, 2, 512, v_heads=32, n_expert=256, n_expert_used=8, n_ff_exp=512,
                           n_ff_shexp=512),
        "122b-a10b": _hybrid(3072, 48, 32, 2, 1024, v_heads=64, n_expert=256, n_expert_used=8, n_ff_exp=1024,
                             n_ff_shexp=1024),
        "397b-a17b": _hybrid(4096, 60, 32, 2, 1024, v_heads=64, n_expert=512, n_expert_used=10, n_ff_exp=1024,
                             n_ff_shexp=1024),
    },
}


def get_shape(arch: str, shape: str, n_layer: int | None = None) -> Shape:
    """The shape `shape` of `arch`, optionally with another layer count; a clear ValueError when unknown."""
    if arch not in SHAPES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    table = SHAPES[arch]
    if shape not in table:
        raise ValueError(f"unknown shape {shape!r} for {arch}; choose one of {', '.join(table)}")
    found = table[shape]
    if n_layer is not None:
        if n_layer < 1:
            raise ValueError("--layers must be at least 1")
        found = replace(found, n_layer=n_layer)
    if found.ssm_state and found.n_layer < found.full_attn_interval:
        # Upstream's hybrid cache aborts unless there is at least one layer of each kind (recurrent and full
        # attention): a short hybrid model makes its last layer the attention one.
        if found.n_layer < 2:
            raise ValueError(f"{arch} needs at least 2 layers (one recurrent, one full attention)")
        found = replace(found, full_attn_interval=found.n_layer)
    return found


def shape_names(arch: str) -> list[str]:
    return list(SHAPES.get(arch, {}))
