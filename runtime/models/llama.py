"""The Llama-family decoder: Llama and Mistral as is, Qwen2 with q/k/v bias, Qwen3 with q/k norm."""

from __future__ import annotations

from collections.abc import Iterable

import arbor_kernels as kernels
import torch
import torch.nn.functional as F
from arbor_kernels.quantized import BlockWeights

from runtime.distributed.group import SINGLE, TPGroup
from runtime.distributed.partition import HeadPartition, Shard
from runtime.forward_batch import ForwardBatch
from runtime.layers.attention import PagedAttention
from runtime.layers.basic import (
    CheckpointTensor,
    Linear,
    RMSNorm,
    fill,
    onednn_packing_available,
    pack_weight,
    packed_linear,
    read_shard,
)
from runtime.layers.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_logits,
)
from runtime.layers.quantized import QuantizedEmbedding, QuantizedLinear
from runtime.layers.rotary import RotaryEmbedding
from runtime.model_config import ModelConfig
from runtime.models.registry import CausalLM

# Checkpoint tensor name -> (our stacked parameter, shard within it).
_STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaAttention(torch.nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        dtype: torch.dtype,
        tp: TPGroup,
    ) -> None:
        super().__init__()
        heads = HeadPartition.of_rank(config.num_heads, config.num_kv_heads, tp.rank, tp.size)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads  # this rank's
        self.head_dim = d = config.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        q = Shard(config.num_heads * d, heads.q_start * d, q_size)
        kv = Shard(config.num_kv_heads * d, heads.kv_start * d, kv_size)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, {"q": q, "k": kv, "v": kv}, qkv_bias, dtype
        )
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, o_bias, dtype, tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.attn = PagedAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim)
        self._split = [q_size, kv_size, kv_size]

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        last_rows: bool = False,
    ) -> torch.Tensor:
        """[T, hidden]; with ``last_rows`` only the rows ``batch.logit_indices`` ([N, hidden]),
        every token's K/V still written."""
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        if not last_rows and self.attn.fuses(batch):
            norms = (self.q_norm, self.k_norm)
            return self.o_proj(self.attn.forward_decode(qkv, cos_sin, norms, batch))
        tokens = x.shape[0]
        q, k, v = qkv.split(self._split, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotate_and_attend(self.attn, self.o_proj, (q, k, v), cos_sin, batch, last_rows)


def rotate_and_attend(
    attn: PagedAttention,
    o_proj: torch.nn.Module,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    batch: ForwardBatch,
    last_rows: bool,
) -> torch.Tensor:
    """The output projection of attention over q [T, H, D], k and v [T, Hkv, D] once q and k
    are rotated: every row's, or (``last_rows``) only the rows ``batch.logit_indices`` names."""
    q, k, v = qkv
    q, k = kernels.apply_rotary_emb(q, k, *cos_sin)
    if last_rows:
        return o_proj(attn.forward_last_rows(q[batch.logit_indices], k, v, batch))
    out: torch.Tensor = o_proj(attn(q, k, v, batch))
    return out


class LlamaMLP(torch.nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TPGroup) -> None:
        super().__init__()
        inter = config.intermediate_size
        part = Shard.even(inter, tp.rank, tp.size)
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, {"gate": part, "up": part}, config.mlp_bias, dtype
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, config.mlp_bias, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TPGroup, **attn_kw: bool
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, dtype=dtype, tp=tp, **attn_kw)
        self.mlp = LlamaMLP(config, dtype, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        last_rows: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block with the residual add fused into the next norm: returns (x, residual)
        such that x + residual is the block's output; with ``last_rows``, for the logit rows
        only (the K/V of every token is still written)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, batch, last_rows)
        if last_rows:
            residual = residual[batch.logit_indices]
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(torch.nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, tp: TPGroup, **attn_kw: bool
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.layers = torch.nn.ModuleList(
            LlamaDecoderLayer(config, i, dtype, tp, **attn_kw) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Returns the final normed hidden states of the rows ``batch.logit_indices``, [N,
        hidden]. When those are last tokens of their requests (``batch.logit_reqs``), the last
        layer computes only them past its K/V (attention output, MLP, norm), as llama.cpp
        does: the other rows' outputs feed nothing."""
        x = self.embed_tokens(batch.input_ids)
        cos_sin = self.rotary(batch.positions)
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, residual = layer(
                x, residual, cos_sin, batch, i == last and batch.logit_reqs is not None
            )
        assert residual is not None
        if batch.logit_reqs is None:
            x, residual = x[batch.logit_indices], residual[batch.logit_indices]
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(CausalLM):
    """Loads Hugging Face checkpoints of this family; q/k/v and gate/up are stacked on load.
    As rank ``tp.rank`` of a tensor-parallel group, holds and loads only that rank's shards."""

    qk_norm = False

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        qkv_bias, o_bias = self.projection_biases(config)
        self.model = LlamaModel(
            config, dtype, tp, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=self.qk_norm
        )
        vocab = Shard.padded(config.vocab_size, tp.rank, tp.size)  # the embedding's rows too
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else ColumnParallelLinear(config.hidden_size, vocab, False, dtype)
        )
        self._tied_head_packed: torch.Tensor | None = None

    @staticmethod
    def projection_biases(config: ModelConfig) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias)."""
        return config.attention_bias, config.attention_bias

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [N, vocab] float32 for the packed rows ``batch.logit_indices`` (on ranks
        other than 0 of a tensor-parallel group: this rank's block of the vocabulary)."""
        hidden = self.model(batch)
        embedding = self.model.embed_tokens
        if self.lm_head is not None:
            local = self.lm_head(hidden)
        elif isinstance(embedding, QuantizedEmbedding):
            local = embedding.logits(hidden)
        elif self._tied_head_packed is not None:
            local = packed_linear(hidden, self._tied_head_packed, None)
        elif kernels.deterministic():
            local = kernels.fixed_order_linear(hidden, embedding.weight, None)
        else:
            local = F.linear(hidden, embedding.weight)
        return gather_logits(self.tp, local.float(), self.config.vocab_size)

    def pack_weights(self) -> None:
        """Also packs the tied output projection: a packed copy of the embedding, which the
        input lookup still needs in its plain layout."""
        super().pack_weights()
        embedding = self.model.embed_tokens
        if (
            self.lm_head is None
            and isinstance(embedding, VocabParallelEmbedding)
            and onednn_packing_available(embedding.weight)
        ):
            self._tied_head_packed = pack_weight(embedding.weight)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Fill the parameters (this rank's shards of them) from checkpoint tensors with their
        Hugging Face names; raise naming any tensor that has no parameter or parameter left
        unfilled. ``BlockWeights`` (a GGUF file's blocks, kept) for a projection or the
        embedding replace that layer by its quantized form (runtime/layers/quantized.py) on a
        single rank; elsewhere they are dequantized."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        blocks: dict[str, dict[str, BlockWeights]] = {}  # module -> stacked piece -> blocks
        pending = set()
        for pname in params:
            owner = modules[pname.rsplit(".", 1)[0]]
            shards = owner.shard_offsets if isinstance(owner, Linear) else {"": None}
            pending |= {(pname, shard) for shard in shards}
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name.startswith("lm_head.") and self.lm_head is None:
                continue  # tied checkpoints may still carry a copy of the embedding
            module_name, param_kind = name.rsplit(".", 1)
            parent, _, leaf = module_name.rpartition(".")
            shard = ""
            if leaf in _STACKED:
                leaf, shard = _STACKED[leaf]
                module_name = f"{parent}.{leaf}"
            param_name = f"{module_name}.{param_kind}"
            param = params.get(param_name)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}"
                )
            owner = modules[module_name]
            if isinstance(tensor, BlockWeights):
                if self._keeps_blocks(owner, param_kind, shard, tensor, name):
                    blocks.setdefault(module_name, {})[shard] = tensor
                    pending.discard((param_name, shard))
                    continue
                tensor = tensor.dequantize()
            if isinstance(owner, (Linear, VocabParallelEmbedding)):
                owner.load(param_kind, shard, tensor, name)
            else:  # replicated on every rank
                fill(param.data, read_shard(tensor, name, tuple(param.shape)))
            pending.discard((param_name, shard))
        if pending:
            missing = sorted(f"{m}[{s}]" if s else m for m, s in pending)
            raise ValueError(f"checkpoint lacks weights for: {', '.join(missing[:8])}")
        for module_name, pieces in blocks.items():
            self._quantize(module_name, modules[module_name], pieces)

    def _keeps_blocks(
        self, owner: torch.nn.Module, kind: str, piece: str, blocks: BlockWeights, name: str
    ) -> bool:
        """Whether ``blocks`` (checkpoint tensor ``name``) stay blocks: a projection's or the
        embedding's whole weight on a single rank. ValueError for a wrong shape."""
        if self.tp.size != 1 or kind != "weight":
            return False
        if isinstance(owner, Linear):
            expected = (owner.out_shards[piece].full, owner.in_shard.full)
        elif isinstance(owner, VocabParallelEmbedding):
            expected = (owner.shard.full, owner.dim)
        else:
            return False
        if blocks.shape != expected:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {blocks.shape}, expected {expected}"
            )
        return True

    def _quantize(
        self, module_name: str, owner: torch.nn.Module, pieces: dict[str, BlockWeights]
    ) -> None:
        """Put the quantized form of loaded layer ``owner`` in its place."""
        parent, _, leaf = module_name.rpartition(".")
        quantized: torch.nn.Module
        if isinstance(owner, Linear):
            quantized = QuantizedLinear.of(owner, pieces)
        else:
            assert isinstance(owner, VocabParallelEmbedding)
            quantized = QuantizedEmbedding(pieces[""], owner.weight.dtype)
        setattr(self.get_submodule(parent) if parent else self, leaf, quantized)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: q/k/v projections always carry a bias; o_proj never does."""

    @staticmethod
    def projection_biases(config: ModelConfig) -> tuple[bool, bool]:
        return True, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: per-head RMSNorm on q and k before the rotary embedding."""

    qk_norm = True
