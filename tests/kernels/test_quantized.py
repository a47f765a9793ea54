"""Quantized block weights: ``pack`` loses nothing, the torch reference quantizes activations
as stated and stays within its bound of the float product, and the native kernels (AVX-512
VNNI and the portable path forced by ARBOR_CPU_PORTABLE=1) equal the reference."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import arbor_kernels as kernels
import pytest
import torch
from arbor_kernels import cpu_native, dispatch
from arbor_kernels.quantized import BlockWeights, QuantizedWeight, pack
from arbor_kernels.reference import quantized as reference

BLOCKS = [(4, 16), (4, 32), (8, 16), (8, 32)]  # (bits, block)
N = 37  # not a multiple of the 16-row group


def _blocks(
    n: int, k: int, bits: int, block: int, half: bool, seed: int, activations: str = "f32"
) -> BlockWeights:
    """Codes over their whole range; GGUF-like scales (float16-exact when ``half``) and
    offsets that centre the codes, as Q8_0 and Q4_0 read as unsigned codes do."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // block, generator=gen) * 0.02 + 0.001
    offset = -scale * 2 ** (bits - 1) + torch.randn(n, k // block, generator=gen) * 0.01
    if half:
        scale, offset = scale.half().float(), offset.half().float()
    return BlockWeights(q, scale, offset, bits, block, activations)


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[0, :16] = 0.0  # an all-zero block: scale 0, codes 0
    return x


def _magnitude(x: torch.Tensor, blocks: BlockWeights) -> torch.Tensor:
    """|x| times the weight with |scale| and |offset|: the size of the sums' terms, which
    float32 rounding is relative to."""
    absolute = BlockWeights(
        blocks.q, blocks.scale.abs(), blocks.offset.abs(), blocks.bits, blocks.block
    )
    return x.abs() @ absolute.dequantize().t()


@pytest.mark.parametrize(("bits", "block"), BLOCKS)
@pytest.mark.parametrize("half", [True, False])
@pytest.mark.parametrize("n", [1, 16, N])
def test_pack_is_lossless(bits: int, block: int, half: bool, n: int) -> None:
    blocks = _blocks(n, 64, bits, block, half, seed=n)
    packed = pack(blocks)
    assert (packed.n, packed.k, packed.half_scales) == (n, 64, half)
    back = packed.unpack()
    assert torch.equal(back.q, blocks.q)
    assert torch.equal(back.scale, blocks.scale) and torch.equal(back.offset, blocks.offset)
    assert torch.equal(back.dequantize(), blocks.dequantize())
    codes = -(-n // 16) * 16 * 64 * bits // 8
    assert packed.nbytes() == codes + 2 * -(-n // 16) * 16 * (64 // block) * (2 if half else 4)


def test_activation_quantization() -> None:
    x = torch.tensor([[0.0] * 16 + [254.0, -127.0, 0.5, 1.5, 2.5, -0.5] + [0.0] * 10])
    codes, scale, factor = reference.quantize_activations(x, 16)
    assert scale.tolist() == [[0.0, 2.0]]
    # x / 2 rounded half to even: 127, -63.5 -> -64, 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, -0.25 -> 0
    assert codes[0, 16:22].tolist() == [127, -64, 0, 1, 1, 0]
    assert codes[0, :16].eq(0).all() and factor.tolist() == [[0.0, 130.0]]


def test_activation_formats_round_as_llama_cpp() -> None:
    # d = 100 / 127 is no float16: q8_0 and q8_1 round it; codes sum to 127 + 1 + 2 = 130.
    x = torch.tensor([[100.0, 0.8, 1.6] + [0.0] * 29])
    d = torch.tensor(100.0) / 127
    for activations in ("f32", "q8_0", "q8_1"):
        codes, scale, factor = reference.quantize_activations(x, 32, activations)
        assert codes[0, :3].tolist() == [127, 1, 2]
        rounded = d if activations == "f32" else d.half().float()
        assert scale.item() == rounded.item()
        want = {"f32": d * 130, "q8_0": rounded * 130, "q8_1": (d * 130).half().float()}
        assert factor.item() == want[activations].item()
    assert reference.quantize_activations(x, 32, "q8_1")[2] != d.half().float() * 130


@pytest.mark.parametrize(("bits", "block"), BLOCKS)
@pytest.mark.parametrize("k", [64, 576])
@pytest.mark.parametrize("activations", ["f32", "q8_0", "q8_1"])
def test_reference_within_bound_of_float(bits: int, block: int, k: int, activations: str) -> None:
    blocks = _blocks(N, k, bits, block, True, seed=k + bits, activations=activations)
    weight, x = pack(blocks), _x(5, k, seed=1)
    y = reference.quantized_linear(x, weight, None)
    exact = reference.quantized_linear_float(x.double(), weight, None)
    bound = reference.activation_error_bound(x, weight)
    error = (y.double() - exact).abs()
    assert (error <= bound * 1.001 + 1e-5 * _magnitude(x, blocks)).all()
    # The bound is not vacuous: the activation rounding is a small relative error.
    assert (bound <= 0.05 * _magnitude(x, blocks)).all()
    assert error.max() > 0


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    if not kernels.native_available():
        pytest.skip("native CPU kernels are not built: run `python -m arbor_kernels.cpu_native`")
    module = cpu_native.load()
    assert module is not None
    return module


@pytest.fixture(params=["vnni", "portable"])
def path(
    request: pytest.FixtureRequest, ext: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    if request.param == "portable":
        monkeypatch.setenv("ARBOR_CPU_PORTABLE", "1")
        assert ext.quantized_isa() == "portable"
    else:
        monkeypatch.delenv("ARBOR_CPU_PORTABLE", raising=False)
        if ext.quantized_isa() != "avx512_vnni":
            pytest.skip("this build has no AVX-512 VNNI path")
    yield request.param


def _native(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return dispatch._impls["quantized_linear"]["native"](x, weight, bias)


@pytest.mark.parametrize(("bits", "block"), BLOCKS)
@pytest.mark.parametrize("m", [1, 3, 8, 33])
@pytest.mark.parametrize("k", [64, 576, 1536])
def test_native_matches_reference(path: str, bits: int, block: int, m: int, k: int) -> None:
    blocks = _blocks(N, k, bits, block, half=block == 32, seed=m + k)
    weight, x = pack(blocks), _x(m, k, seed=m)
    y = _native(x, weight, None)
    expected = reference.quantized_linear(x, weight, None)
    assert y.shape == (m, N) and y.dtype == torch.float32
    assert ((y - expected).abs() <= 2e-6 * _magnitude(x, blocks) + 1e-7).all()


@pytest.mark.parametrize(("bits", "block"), BLOCKS)
@pytest.mark.parametrize("activations", ["q8_0", "q8_1"])
@pytest.mark.parametrize("m", [1, 5])
def test_native_rounds_activations_as_reference(
    path: str, bits: int, block: int, activations: str, m: int
) -> None:
    blocks = _blocks(N, 576, bits, block, half=True, seed=m + bits, activations=activations)
    weight, x = pack(blocks), _x(m, 576, seed=m)
    assert weight.activations == activations and weight.unpack().activations == activations
    y = _native(x, weight, None)
    expected = reference.quantized_linear(x, weight, None)
    assert ((y - expected).abs() <= 2e-6 * _magnitude(x, blocks) + 1e-7).all()
    # The rounding is there: the float32 scales give other numbers.
    plain = pack(BlockWeights(blocks.q, blocks.scale, blocks.offset, bits, block))
    assert not torch.equal(y, _native(x, plain, None))


@pytest.mark.parametrize("half", [True, False])
def test_native_bias_and_shapes(path: str, half: bool) -> None:
    blocks = _blocks(N, 64, 4, 32, half, seed=3)
    weight, x = pack(blocks), _x(6, 64, seed=2)
    bias = torch.randn(N)
    y = _native(x.view(2, 3, 64), weight, bias)
    assert y.shape == (2, 3, N)
    expected = reference.quantized_linear(x, weight, bias).view(2, 3, N)
    assert ((y - expected).abs() <= 2e-6 * _magnitude(x, blocks).view(2, 3, N) + 1e-6).all()
    assert _native(x[:0], weight, bias).shape == (0, N)


def test_native_threads_split_groups_alike(path: str) -> None:
    blocks = _blocks(200, 576, 4, 32, True, seed=4)
    weight, x = pack(blocks), _x(9, 576, seed=4)
    one = _native(x, weight, None)
    torch.set_num_threads(2)
    try:
        two = _native(x, weight, None)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one, two)


@pytest.mark.parametrize(("bits", "block"), BLOCKS)
@pytest.mark.parametrize("half", [True, False])
def test_rows_exact(ext: ModuleType, bits: int, block: int, half: bool) -> None:
    blocks = _blocks(N, 576, bits, block, half, seed=bits + block)
    weight = pack(blocks)
    index = torch.tensor([0, 36, 17, 17, 5])
    expected = blocks.dequantize()[index]
    assert torch.equal(reference.quantized_rows(index, weight), expected)
    rows = dispatch._impls["quantized_rows"]["native"](index, weight)
    assert torch.equal(rows, expected)
    with pytest.raises(RuntimeError, match="out of range"):
        dispatch._impls["quantized_rows"]["native"](torch.tensor([N]), weight)


def test_ops_pick_native(ext: ModuleType) -> None:
    weight = pack(_blocks(N, 64, 8, 32, True, seed=5))
    x = _x(2, 64, seed=5)
    assert (
        dispatch.resolve("quantized_linear", x.device)
        is dispatch._impls["quantized_linear"]["native"]
    )
    torch.testing.assert_close(
        kernels.quantized_linear(x, weight, None), reference.quantized_linear(x, weight, None)
    )
