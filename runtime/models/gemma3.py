"""Gemma 3's text decoder (Gemma3ForCausalLM), as transformers' Gemma3 computes it.

What sets it apart from the Llama family: five layers of six attend within a sliding window
(``ModelConfig.layer_windows``) with their own RoPE base; per-head RMSNorm on q and k; four
norms a layer (around attention and around the MLP), each scaling by 1 + w; a gelu-tanh gated
MLP; embeddings scaled by sqrt(hidden_size); attention scores scaled by
query_pre_attn_scalar ** -0.5. The head and the weight loader (quantized GGUF blocks included)
are the Llama family's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from runtime.distributed.group import SINGLE, TPGroup
from runtime.distributed.partition import HeadPartition, Shard
from runtime.forward_batch import ForwardBatch
from runtime.layers.attention import PagedAttention
from runtime.layers.basic import CheckpointTensor, RMSNorm
from runtime.layers.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from runtime.layers.rotary import RotaryEmbedding
from runtime.model_config import ModelConfig
from runtime.models.llama import LlamaForCausalLM, rotate_and_attend
from runtime.models.registry import CausalLM

CosSin = tuple[torch.Tensor, torch.Tensor]


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), computed in float32 and cast back to x's dtype.

    ``weight`` is float32 whatever the model's dtype. The loader fills it with w, as
    checkpoints store it; ``fold_one`` then makes it 1 + w, so that from there on it is a plain
    RMSNorm's scale and the RMSNorm kernels (and the fused decode op) apply to float32 input."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps, torch.float32)

    def fold_one(self) -> None:
        """After loading: the weight becomes the scale 1 + w."""
        self.weight.data += 1.0

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As ``RMSNorm.forward``. For x in float32 the kernels compute what the reference
        does; in another dtype the reference scales before rounding, as done here."""
        if x.dtype == torch.float32:
            return super().forward(x, residual)
        if residual is not None:
            residual = x + residual
            x = residual
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        out = normed.to(x.dtype)
        return out if residual is None else (out, residual)


def _norm(norm: GemmaRMSNorm, x: torch.Tensor) -> torch.Tensor:
    out = norm(x)
    assert isinstance(out, torch.Tensor)
    return out


def _add_norm(
    norm: GemmaRMSNorm, x: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    out = norm(x, residual)
    assert isinstance(out, tuple)
    return out


class Gemma3Attention(torch.nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TPGroup) -> None:
        super().__init__()
        heads = HeadPartition.of_rank(config.num_heads, config.num_kv_heads, tp.rank, tp.size)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads  # this rank's
        self.head_dim = d = config.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        q = Shard(config.num_heads * d, heads.q_start * d, q_size)
        kv = Shard(config.num_kv_heads * d, heads.kv_start * d, kv_size)
        bias = config.attention_bias
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, {"q": q, "k": kv, "v": kv}, bias, dtype
        )
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, bias, dtype, tp)
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        assert config.query_pre_attn_scalar is not None
        self.attn = PagedAttention(
            layer_id, self.num_heads, self.num_kv_heads, d,
            scale=config.query_pre_attn_scalar**-0.5, window=config.window(layer_id),
        )  # fmt: skip
        self._split = [q_size, kv_size, kv_size]

    def forward(
        self, x: torch.Tensor, cos_sin: CosSin, batch: ForwardBatch, last_rows: bool = False
    ) -> torch.Tensor:
        """[T, hidden]; with ``last_rows`` only the rows ``batch.logit_indices`` ([N, hidden]),
        every token's K/V still written."""
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        # The fused op scales by the norms' weights as RMSNorm does: exact for float32 only.
        if not last_rows and x.dtype == torch.float32 and self.attn.fuses(batch):
            norms = (self.q_norm, self.k_norm)
            return self.o_proj(self.attn.forward_decode(qkv, cos_sin, norms, batch))
        tokens = x.shape[0]
        q, k, v = qkv.split(self._split, dim=-1)
        q = _norm(self.q_norm, q.view(tokens, self.num_heads, self.head_dim))  # [T, H, D]
        k = _norm(self.k_norm, k.view(tokens, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        return rotate_and_attend(self.attn, self.o_proj, (q, k, v), cos_sin, batch, last_rows)


class Gemma3MLP(torch.nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TPGroup) -> None:
        super().__init__()
        inter = config.intermediate_size
        part = Shard.even(inter, tp.rank, tp.size)
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, {"gate": part, "up": part}, False, dtype
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, False, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TPGroup) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.windowed = config.window(layer_id) > 0
        self.self_attn = Gemma3Attention(config, layer_id, dtype, tp)
        self.mlp = Gemma3MLP(config, dtype, tp)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: CosSin,
        batch: ForwardBatch,
        last_rows: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (x, residual) such that x + residual is the block's output (the add fused
        into the next norm); with ``last_rows``, for the logit rows only."""
        if residual is None:
            h, residual = _norm(self.input_layernorm, x), x
        else:
            h, residual = _add_norm(self.input_layernorm, x, residual)
        h = _norm(self.post_attention_layernorm, self.self_attn(h, cos_sin, batch, last_rows))
        if last_rows:
            residual = residual[batch.logit_indices]
        h, residual = _add_norm(self.pre_feedforward_layernorm, h, residual)
        return _norm(self.post_feedforward_layernorm, self.mlp(h)), residual


class Gemma3Model(torch.nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TPGroup) -> None:
        super().__init__()
        # The reference scales in the embedding's dtype: sqrt(hidden) rounded to it first.
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5, dtype=dtype))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        local_theta = config.local_rope_theta
        self.local_rotary = RotaryEmbedding(
            config.head_dim,
            config.rope_theta if local_theta is None else local_theta,
            config.local_rope_scaling,
        )
        self.layers = torch.nn.ModuleList(
            Gemma3DecoderLayer(config, i, dtype, tp) for i in range(config.num_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The final normed hidden states of the rows ``batch.logit_indices``, [N, hidden]
        (as ``LlamaModel.forward``, the last layer computes only those rows past its K/V when
        they are their requests' last tokens)."""
        x = self.embed_tokens(batch.input_ids) * self.embed_scale  # [T, hidden]
        global_cos_sin = self.rotary(batch.positions)
        local_cos_sin = self.local_rotary(batch.positions)
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            cos_sin = local_cos_sin if layer.windowed else global_cos_sin
            x, residual = layer(
                x, residual, cos_sin, batch, i == last and batch.logit_reqs is not None
            )
        assert residual is not None
        if batch.logit_reqs is None:
            x, residual = x[batch.logit_indices], residual[batch.logit_indices]
        x, _ = _add_norm(self.norm, x, residual)
        return x


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Loads Hugging Face Gemma 3 text checkpoints (``gemma3_text``) and GGUF files of
    architecture ``gemma3`` (their norm weights shifted back to w by the GGUF reader). The
    head (tied to the embedding unless the config says otherwise), the loader and the quantized
    layers are ``LlamaForCausalLM``'s; the decoder is ``Gemma3Model``."""

    # The Llama head and loader use only ``embed_tokens`` and the forward of the decoder.
    model: Gemma3Model  # type: ignore[assignment]

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TPGroup = SINGLE) -> None:
        CausalLM.__init__(self)  # not LlamaForCausalLM's: that builds a Llama decoder
        self.config = config
        self.tp = tp
        self.model = Gemma3Model(config, dtype, tp)
        vocab = Shard.padded(config.vocab_size, tp.rank, tp.size)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else ColumnParallelLinear(config.hidden_size, vocab, False, dtype)
        )
        self._tied_head_packed = None

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """As ``LlamaForCausalLM.load_weights``; then every norm's weight becomes 1 + w."""
        super().load_weights(weights)
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.fold_one()
