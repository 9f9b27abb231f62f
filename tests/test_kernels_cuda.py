"""GPU builds without a GPU: the CUDA C++ GEMV compiled with nvcc, the Triton kernels compiled for sm_90;
and on a GPU, the CUDA GEMV against the oracle."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantkit.kernels import cuda_ext, reference

HAS_GPU = torch.cuda.is_available()


def _triton_ptxas() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    ptxas = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return ptxas if ptxas.exists() else None


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.Popen, Path]]:
    """Start both compile checks at once (each is ~10-20 s of one core), so their times overlap."""
    out = tmp_path_factory.mktemp("builds")
    jobs: dict[str, tuple[subprocess.Popen, Path]] = {}
    if shutil.which("nvcc"):
        jobs["nvcc"] = (subprocess.Popen(cuda_ext.nvcc_command(out), stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True), out)
    if _triton_ptxas():  # its own process: this one's Triton interpreter mode is fixed at import
        env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "quantkit.kernels.aot_check", "--level", "smoke"]
        jobs["triton"] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                           env=env, cwd=Path(__file__).resolve().parents[1]), out)
    yield jobs
    for proc, _ in jobs.values():
        if proc.poll() is None:
            proc.kill()


def _finish(proc: subprocess.Popen) -> str:
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    return output


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_kernel_source_compiles_with_nvcc(builds: dict) -> None:
    proc, out = builds["nvcc"]
    _finish(proc)
    assert (out / "w4a16_gemv.o").stat().st_size > 0


@pytest.mark.skipif(_triton_ptxas() is None, reason="triton with its bundled ptxas is not installed")
def test_triton_kernels_compile_for_hopper(builds: dict) -> None:
    output = _finish(builds["triton"][0])
    assert "4/4 kernels compiled for sm_90" in output
    assert output.count("stack=0 ") == 4  # no register spills


def test_gemv_support_rules() -> None:
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    assert not cuda_ext.cuda_gemv_supported(x, 256, 32)  # CPU tensor
    if HAS_GPU:
        gx = x.cuda()
        assert cuda_ext.cuda_gemv_supported(gx, 256, 32)
        assert not cuda_ext.cuda_gemv_supported(gx.float(), 256, 32)
        assert not cuda_ext.cuda_gemv_supported(torch.zeros(9, 256, dtype=torch.bfloat16, device="cuda"), 256, 32)


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("g", [32, 64, 128])
def test_cuda_gemv_matches_reference(m: int, g: int) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    n, k = 300, 1024
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    wp = pack_to_int32(q, 4).cuda()
    ws = (torch.rand(n, k // g) * 0.05).to(torch.bfloat16).cuda()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = cuda_ext.cuda_w4a16_linear(x, wp, ws, g)
    ref = reference.w4a16_linear_ref(x.float(), wp, ws, g)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
