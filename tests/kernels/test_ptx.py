"""What the sm_90a kernels compile to, checked in PTX without a GPU (`nvcc -ptx`): the instructions a
kernel's design relies on must be there, or the design silently fell back (e.g. a 16-byte load the
compiler could not prove aligned becomes sixteen 1-byte loads and the kernel loses half its
bandwidth). Skipped where nvcc is missing; CI has it."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")


def cutlass_include() -> str:
    """The nvidia-cutlass wheel's headers, as CMake finds them (cmake/dependencies.cmake)."""
    import cutlass_library

    return str(Path(cutlass_library.__file__).parent / "source" / "include")


_COMPILED: dict[tuple, dict[str, str]] = {}  # (source, arch, flags) -> its kernels: each file compiled once a run


def kernels_ptx(source: str, tmp_path: Path, arch: str = "90a", flags: tuple[str, ...] = ()) -> dict[str, str]:
    """Each kernel's PTX in `source` (relative to csrc/), by mangled name."""
    key = (source, arch, flags)
    if key not in _COMPILED:
        _COMPILED[key] = _compile_ptx(source, tmp_path, arch, flags)
    return _COMPILED[key]


def _compile_ptx(source: str, tmp_path: Path, arch: str, flags: tuple[str, ...]) -> dict[str, str]:
    out = tmp_path / "out.ptx"
    subprocess.run([NVCC, "-ptx", "-std=c++17", f"-I{ROOT / 'csrc'}", *flags,
                    f"-gencode=arch=compute_{arch},code=compute_{arch}", str(ROOT / "csrc" / source), "-o", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    return split_kernels(out.read_text(), source)


def split_kernels(ptx: str, source: str) -> dict[str, str]:
    entries = list(re.finditer(r"^\.(?:visible )?\.?entry (\w+)\(", ptx, re.M))
    assert entries, f"no kernel in {source}'s PTX"
    return {entry.group(1): ptx[entry.start():(entries[i + 1].start() if i + 1 < len(entries) else len(ptx))]
            for i, entry in enumerate(entries)}


def test_nf4_dequantize_stores_16_bytes_per_thread_with_loads_in_flight(tmp_path):
    """Each thread's unit is one 16-byte store (8 bf16 / fp16, 4 fp32 values) from one 4- / 2-byte
    load of packed codes, consecutive threads on consecutive units (a warp stores 512 contiguous
    bytes), four loads issued before the first decode, and no division in the variant for
    power-of-two blocksizes (every bitsandbytes one). A store the compiler split, loads it
    serialized behind the stores, or a 64-bit division per 8 values would show here."""
    kernels = {name: ptx for name, ptx in kernels_ptx("nf4/nf4.cu", tmp_path).items() if "dequantize_kernel" in name
               and "dynamic8" not in name}
    assert len(kernels) == 6, list(kernels)  # fp32, fp16, bf16 outputs; block lookups by shift or division
    for name, ptx in kernels.items():
        fp32 = "st.global.v4.f32" in ptx
        loads = [m.start() for m in re.finditer(r"ld\.global\.nc\.u16" if fp32 else r"ld\.global\.nc\.u32", ptx)]
        stores = [m.start() for m in re.finditer(r"st\.global\.v4\.(?:[bu]32|f32)", ptx)]
        assert len(stores) >= 4, f"{name}: {len(stores)} 16-byte stores (one per unit)"
        in_flight = [at for at in loads if at < stores[0]]
        assert len(in_flight) >= 4, f"{name}: {len(in_flight)} loads of packed codes before the first store, not 4"
        if "Lb1E" in name:  # the power-of-two blocksizes' kernel: its block lookups are shifts
            assert not re.search(r"\bdiv\.[su]", ptx), f"{name}: a division in the shift variant"
    assert sum("Lb1E" in name for name in kernels) == 3


def test_nf4_dequantize_by_warps_loads_16_bytes_per_lane_with_chunks_in_flight(tmp_path):
    """PYKERNELS_NF4_DEQUANT=warps: a lane's codes of a chunk come in one 16-byte load, both chunks'
    loads issued before the first store; they pass through shared memory (one 16-byte store per lane),
    each unit's scale arrives by shuffle, each unit leaves in one 16-byte store, and no division."""
    kernels = {name: ptx for name, ptx in kernels_ptx("nf4/nf4.cu", tmp_path).items()
               if "dequantize_warps_kernel" in name}
    assert len(kernels) == 3, list(kernels)  # fp32, fp16, bf16 outputs
    for name, ptx in kernels.items():
        loads = [m.start() for m in re.finditer(r"ld\.global(?:\.nc)?\.v4\.[bu]32", ptx)]
        stores = [m.start() for m in re.finditer(r"st\.global\.v4\.(?:[bu]32|f32)", ptx)]
        assert stores, f"{name}: no 16-byte store"
        assert len([at for at in loads if at < stores[0]]) >= 2, f"{name}: the chunks' loads are not in flight together"
        assert re.search(r"st\.shared\.v4\.[bu]32", ptx), f"{name}: codes not staged 16 bytes a lane"
        assert re.search(r"shfl\.sync\.idx", ptx), f"{name}: no shuffle of block scales"
        assert not re.search(r"\bdiv\.[su]", ptx), f"{name}: a division"


def test_lora_rank_gemm_reads_shared_memory_16_bytes_at_a_time(tmp_path):
    """The SIMT rank GEMM (fp32 LoRA factors against 16-bit activations) is bound by its shared-memory
    loads: per slice of 16 k, each thread's groups of 4 values are one ld.shared.v4 each (lora.h,
    rank_fragment_index), 32 of them, and at most 16 single loads beside 128 (thin tiles) or 256
    (64 x 64) FMAs. The strided layout before took 144 scalar loads per 128 FMAs (~15 TFLOP/s)."""
    kernels = {name: ptx for name, ptx in kernels_ptx("lora/lora.cu", tmp_path).items() if "rank_gemm_kernel" in name}
    assert len(kernels) == 3, list(kernels)  # the 128 x 16, 16 x 128 and 64 x 64 tiles
    for name, ptx in kernels.items():
        vector = len(re.findall(r"ld\.shared\.v4\.f32", ptx))
        single = len(re.findall(r"ld\.shared\.f32", ptx))
        assert vector >= 32 and single <= 16, f"{name}: {vector} 16-byte and {single} 4-byte shared loads"
        assert "ld.local" not in ptx and "st.local" not in ptx, f"{name}: spills to local memory"


def sm90_kernels_ptx(source: str, tmp_path: Path) -> dict[str, str]:
    """Each kernel's PTX in an sm_90a-only source: the PTX make cuda-check kept (PYKERNELS_PTX_DIR,
    Makefile), else compiled here with the flags cmake/sm90_sources.cmake uses."""
    kept = os.environ.get("PYKERNELS_PTX_DIR")
    if kept:
        ptx = Path(kept) / (Path(source).stem + ".ptx")
        assert ptx.is_file(), f"{ptx} missing: make cuda-check keeps it (cmake/cuda_compile_check.cmake)"
        return split_kernels(ptx.read_text(), source)
    flags = ("-DPYKERNELS_SM90A_GEMM", "-DNDEBUG", "--expt-relaxed-constexpr", f"-I{cutlass_include()}")
    return kernels_ptx(source, tmp_path, flags=flags)


# The GEMM core's tiles (common/sm90_tiles.h), one file each, and the wgmma shape each one issues: a
# consumer warpgroup's 64 rows by the tile's N.
SM90_CORE_TILES = {"128x128": "m64n128k16", "128x256": "m64n256k16"}
# logprobs/logprobs_sm90.h: each 128 vocabulary entries wide, both cooperative
LOGPROBS_TILES = ("128x128", "256x128")


@pytest.mark.hopper_ptx
@pytest.mark.parametrize("tile", SM90_CORE_TILES)
def test_hopper_gemm_core_is_wgmma_fed_by_tma(tmp_path, tile):
    """The sm_90a GEMM core (common/grouped_gemm_sm90.cu dispatching to a file per tile) runs the MoE
    expert GEMMs (bf16 out: forward, grad_x, weight gradient; with LoRA on the experts, the two
    extra-K kernels), the LoRA GEMMs (bf16 out; the forward, Hopper's default PYKERNELS_SM90_LORA,
    on the extra-K kernel), the logprobs GEMMs (fp32 out: dh, dW) and the experts' gated gate_up GEMM
    (common/paired_rows.h, the extra-K mainloop reading B paired), and that GEMM and the N-major-B
    extra-K one again with A's rows gathered by the producer warp. Each
    tile's eleven kernels must issue bf16 wgmma of the tile's
    width from shared memory that TMA fills: a CUTLASS configuration mistake falls back to mma.sync or
    to cp.async loads without a word."""
    kernels = sm90_kernels_ptx(f"common/grouped_gemm_tile_{tile}_sm90.cu", tmp_path)
    gemms = {name: ptx for name, ptx in kernels.items() if "GemmUniversal" in name}
    assert len(gemms) == 11, list(kernels)
    for name, ptx in gemms.items():
        wgmma = rf"wgmma\.mma_async\.sync\.aligned\.{SM90_CORE_TILES[tile]}\.f32\.bf16\.bf16"
        assert re.search(wgmma, ptx), f"{name}: no bf16 wgmma {SM90_CORE_TILES[tile]}"
        assert "cp.async.bulk.tensor" in ptx, f"{name}: operands not loaded by TMA"
        assert "mma.sync" not in ptx, f"{name}: an Ampere mma.sync path"
    fp32_out = [name for name in gemms if "EpilogueScheduleIfEEEfNS" in name or "LinearCombinationIffff" in name]
    assert len(fp32_out) == 3, "three kernels with fp32 D (the logprobs GEMMs)"
    # The two extra-K kernels (LoRA in the base GEMM) rewrite four TMA descriptors per group where the
    # others rewrite two (A2 and B2 beside A and B; the epilogue's alike): a mainloop that lost its
    # second pair would load the LoRA term through stale descriptors and still compile.
    address_swaps = {name: len(re.findall(r"tensormap\.replace\.tile\.global_address", ptx))
                     for name, ptx in gemms.items()}
    extended = [name for name in gemms if "ExtendedKArrayMainloop" in name]
    assert len(extended) == 5
    gated = [name for name in gemms if "Sm90GatedActStore" in name]
    assert len(gated) == 2 and set(gated) <= set(extended)
    (plain,) = {address_swaps[name] for name in gemms if name not in extended}
    # the gated kernels' epilogue has no C operand: one descriptor fewer than the others' (each swap
    # appears twice in these kernels' PTX)
    want = {name: plain + 4 - (2 if name in gated else 0) for name in extended}
    assert {name: address_swaps[name] for name in extended} == want, address_swaps


@pytest.mark.hopper_ptx
def test_hopper_plain_lora_forward_keeps_its_descriptors_as_parameters(tmp_path):
    """PYKERNELS_SM90_DENSE=plain's kernel (common/dense_gemm_plain_sm90.cu): the LoRA forward's extra-K GEMM on
    CUTLASS's one-problem cooperative kernel (extended_k_mainloop_sm90.cuh), 128x256 wgmma fed by TMA. Its
    descriptors are kernel parameters, never rewritten (what sets it apart from the ptr-array kernels), and it
    prefetches six: A, B, A2 and B2, and the epilogue's C and D. A mainloop that lost its second pair would
    load the LoRA term through the first pair's descriptors and still compile."""
    kernels = sm90_kernels_ptx("common/dense_gemm_plain_sm90.cu", tmp_path)
    gemms = {name: ptx for name, ptx in kernels.items() if "GemmUniversal" in name}
    assert len(gemms) == 1 and "ExtendedKMainloop" in next(iter(gemms)), list(kernels)
    ptx = next(iter(gemms.values()))
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16", ptx)
    assert "cp.async.bulk.tensor" in ptx and "mma.sync" not in ptx
    assert "tensormap.replace" not in ptx, "rewrites a descriptor"
    assert len(re.findall(r"prefetch\.tensormap", ptx)) == 6


@pytest.mark.hopper_ptx
@pytest.mark.parametrize("tile", SM90_CORE_TILES)
def test_hopper_gated_gemm_reads_the_weight_paired_and_writes_the_activation(tmp_path, tile):
    """The experts' gated gate_up GEMM (common/paired_rows.h): B comes through a 3-D TMA descriptor,
    (k, half, j) of the [gate | up] weight, whose dims every group shares (only its address is
    rewritten per expert, where the other extra-K kernels rewrite B's dims too); its epilogue stores
    D by TMA and each column pair's act(gate) * up with 2-byte global stores. A 2-D load of B here
    would be the unpaired weight: gate and up in different tiles, the activation computed from the
    wrong columns, and no error anywhere. The epilogue traps on a fragment whose two columns are not
    one (gate, up) pair; the register coordinates are static, so the compiler removes that trap when
    it proves every pair whole: a trap left in the PTX is a pairing CUTLASS's layouts no longer keep."""
    kernels = sm90_kernels_ptx(f"common/grouped_gemm_tile_{tile}_sm90.cu", tmp_path)
    gemms = {name: ptx for name, ptx in kernels.items() if "GemmUniversal" in name}
    gated = [ptx for name, ptx in gemms.items() if "Sm90GatedActStore" in name]
    others = [ptx for name, ptx in gemms.items()
              if "ExtendedKArrayMainloop" in name and "Sm90GatedActStore" not in name]
    assert len(gated) == 2  # x read by TMA from slot order, or gathered (the next test)

    def dims_rewritten(ptx: str) -> int:
        return len(re.findall(r"tensormap\.replace\.tile\.global_dim", ptx))

    for ptx in gated:
        assert re.search(r"cp\.async\.bulk\.tensor\.3d\.shared::cluster\.global", ptx), "no 3-D TMA load of B"
        assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx), "D not stored by TMA"
        assert re.search(r"st\.global\.[bu]16", ptx), "no 2-byte stores of act(gate) * up"
        assert "trap;" not in ptx, "the compiler could not prove that every fragment holds (gate, up) pairs"
        assert dims_rewritten(ptx) < min(map(dims_rewritten, others)), "B's dims rewritten per group"


@pytest.mark.hopper_ptx
@pytest.mark.parametrize("tile", SM90_CORE_TILES)
def test_hopper_gathered_rows_are_copied_by_the_producer_warp(tmp_path, tile):
    """PYKERNELS_SM90_MOE_GATHER=mainloop's kernels (extended_k_array_mainloop_sm90.cuh, kGatherA): the
    gated GEMM and the N-major-B extra-K GEMM with A's rows read by token. A comes by 16-byte cp.async
    with a source size (0: the zero-filled rows past a group and columns past K), each lane's copies
    counted on the stage's barrier by cp.async.mbarrier.arrive without .noinc (the barrier expects one
    arrival; the .noinc form would complete the stage before the rows land), and only B by TMA: one
    fewer 2-D TMA load than the same GEMM reading A from slot order."""
    kernels = sm90_kernels_ptx(f"common/grouped_gemm_tile_{tile}_sm90.cu", tmp_path)
    gemms = {name: ptx for name, ptx in kernels.items() if "GemmUniversal" in name}
    gathered = {name: ptx for name, ptx in gemms.items() if "cp.async.cg.shared.global" in ptx}
    assert len(gathered) == 2 and sum("Sm90GatedActStore" in name for name in gathered) == 1, list(gathered)
    for name, ptx in gathered.items():
        assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16, %r\d+;", ptx), name
        assert "cp.async.mbarrier.arrive.shared::cta.b64" in ptx, f"{name}: copies not counted on the barrier"
        assert ".noinc" not in ptx, f"{name}: a .noinc arrive the barrier's count does not expect"
        assert "wgmma.mma_async" in ptx and "mma.sync" not in ptx, name
    two_d = r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global"
    (gated_gathered,) = [ptx for name, ptx in gathered.items() if "Sm90GatedActStore" in name]
    (gated_tma,) = [ptx for name, ptx in gemms.items() if "Sm90GatedActStore" in name and name not in gathered]
    assert len(re.findall(two_d, gated_gathered)) < len(re.findall(two_d, gated_tma)), "A still loaded by TMA"


def test_every_hopper_tile_has_its_file_and_ptx_check():
    """A tile added to common/sm90_tiles.h or logprobs/logprobs_sm90.h without its kernels' file (or
    without a PTX check here) would build, and fail only on a GPU at the first call that picks it."""
    from pykernels import _C

    def files(family: str, prefix: str) -> set[str]:
        return {path.name.removeprefix(prefix).removesuffix("_sm90.cu")
                for path in (ROOT / "csrc" / family).glob(f"{prefix}*_sm90.cu")}

    assert files("common", "grouped_gemm_tile_") == set(_C.host_logic.gemm_sm90_tiles) == set(SM90_CORE_TILES)
    assert files("logprobs", "logprobs_tile_") == set(_C.host_logic.logprobs_sm90_tiles) == set(LOGPROBS_TILES)


@pytest.mark.hopper_ptx
@pytest.mark.parametrize("tile", LOGPROBS_TILES)
def test_hopper_logprobs_keep_the_logits_in_registers(tmp_path, tile):
    """The Hopper lm_head GEMMs (logprobs/logprobs_sm90.cu dispatching to a file per tile) are wgmma
    fed by TMA like the core, with the softmax work in the epilogue: the statistics kernel stores no
    tile at all (no TMA store; its only global stores are the three partial planes, per row a thread
    holds), and the logit-grad kernel stores its bf16 dz tile by TMA. A logits tile written to global
    memory would show as a TMA store or a flood of st.global in the first."""
    kernels = sm90_kernels_ptx(f"logprobs/logprobs_tile_{tile}_sm90.cu", tmp_path)
    gemms = {name: ptx for name, ptx in kernels.items() if "GemmUniversal" in name}
    assert len(gemms) == 2, list(kernels)
    for name, ptx in gemms.items():
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16", ptx), f"{name}: no bf16 wgmma"
        assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", ptx), f"{name}: no TMA loads"
        assert "mma.sync" not in ptx, f"{name}: an Ampere mma.sync path"
        assert "KernelTmaWarpSpecializedCooperative" in name, f"{name}: not cooperative"
    tma_store = r"cp\.async\.bulk\.tensor\.\dd\.global\.shared"
    (stats,) = [ptx for name, ptx in gemms.items() if "SoftmaxPartials" in name]
    (grad,) = [ptx for name, ptx in gemms.items() if "LogitGrad" in name]
    assert not re.search(tma_store, stats), "the statistics kernel stores a tile"
    assert 1 <= len(re.findall(r"st\.global", stats)) <= 12, "the statistics kernel's stores are its partials"
    assert re.search(tma_store, grad), "the logit-grad kernel's dz tile is not stored by TMA"
    assert re.search(r"shfl\.sync", stats), "no shuffle tree over the lanes sharing a row"


@pytest.mark.hopper_ptx
def test_hopper_nf4_gemm_decodes_codes_in_registers(tmp_path):
    """The QLoRA GEMM (nf4/nf4_gemm_sm90.cu): TMA loads the NF4 codes and x, each consumer decodes its
    codes with byte permutes (nf4/nf4_decode_bf16.h: no table in memory) and issues wgmma with A
    from registers (four 32-bit registers, not a shared-memory descriptor). A CUTLASS fallback to its
    integer conversion would drop the permutes; a converter the mainloop did not pick up would not
    compile, and a register spill would show as local memory."""
    kernels = sm90_kernels_ptx("nf4/nf4_gemm_sm90.cu", tmp_path)
    (ptx,) = [ptx for name, ptx in kernels.items() if "GemmUniversal" in name and "MixedInput" in name]
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16 \{[^}]*\},\s*\{([^}]*)\}", ptx)
    assert wgmma, "no bf16 wgmma 256 tokens wide"
    assert all(len(a.split(",")) == 4 for a in wgmma), "wgmma's A does not come from registers"
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", ptx), "no TMA loads"
    assert len(re.findall(r"prmt\.b32", ptx)) >= 64, "the codes are not decoded by byte permutes"
    assert not re.search(r"\.local", ptx), "local memory (spills or a table on the stack)"
    assert "mma.sync" not in ptx


def test_moe_gather_and_token_sums_move_16_bytes(tmp_path):
    """The passes around the Hopper expert GEMMs (the gather of x / dy into slot order, the gates,
    the gated sum over a token's k rows, the gated activation both ways and both layouts) are
    memory-bound: their packed variants (8 bf16 / fp16 or 4 fp32 elements per thread) must load and
    store 16 bytes at a time."""
    kernels = kernels_ptx("moe/moe_routing.cu", tmp_path, flags=("--expt-relaxed-constexpr",))
    packed = {name: ptx for name, ptx in kernels.items()
              if re.search(r"(scale_rows|sum_per_token|gated_act)_kernelI(13__nv_bfloat16Li8|6__halfLi8|fLi4)E", name)}
    assert len(packed) == 18, list(kernels)
    for name, ptx in packed.items():
        assert re.search(r"ld\.global(?:\.nc)?\.v4\.", ptx), f"{name}: no 16-byte load"
        assert re.search(r"st\.global\.v4\.", ptx), f"{name}: no 16-byte store"
