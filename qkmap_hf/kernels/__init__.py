"""The fused CPU kernels: the feature map (``feature_map_cpu.cpp``) and causal attention for keys wider than values
(``attention_cpu.cpp``), built once per machine into one library and loaded into ``torch.ops.qkmap_v1``.

The model files (``qkmap_hf/modeling``, copied into every checkpoint) import only torch: they run a fused kernel
wherever its ops are registered, and the eager map or sdpa with padded values elsewhere
(``feature_map_qkmap.FUSED_OPS``, ``attention_qkmap.FUSED_ATTENTION_OPS``). This module registers them. ``load_fused_kernel`` loads the build of this source for this torch from the per-machine cache
(``$QKMAP_HF_CACHE/kernels``), compiling it first when asked (a C++ compiler, about 5 s). ``import qkmap_hf`` loads an
existing build and never compiles; ``qkmap kernels``, ``scripts/setup.sh`` and training on a CPU build it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..assets import cache_root
from ..fileio import atomic_path
from ..modeling.attention_qkmap import FUSED_ATTENTION_OPS
from ..modeling.feature_map_qkmap import FUSED_NAMESPACE, FUSED_OPS

SOURCES = tuple(Path(__file__).with_name(name) for name in ("feature_map_cpu.cpp", "attention_cpu.cpp"))
COMPILER_ENV = "CXX"
BUILD_TIMEOUT_S = 600
# torch's CPU capability -> the instruction sets ATen's vector types are compiled for (as inductor compiles them).
CAPABILITY_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"],
    "AVX2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}


class KernelBuildError(OSError):
    """The fused kernel could not be built on this machine; the message says why and what to do."""


@dataclass(frozen=True)
class KernelStatus:
    """Whether the fused CPU kernels are registered in this process, from which file, and if not, why."""

    loaded: bool
    path: Path | None
    reason: str = ""
    build_seconds: float | None = None

    def line(self) -> str:
        if self.loaded:
            built = f" (built in {self.build_seconds:.1f} s)" if self.build_seconds is not None else ""
            return f"fused CPU kernels (feature map, wide-key attention): torch.ops.{FUSED_NAMESPACE} loaded from {self.path}{built}"
        return f"fused CPU kernels: not loaded ({self.reason}); the eager feature map and sdpa with padded values run"


def compiler() -> str | None:
    """The C++ compiler (``$CXX``, else ``c++``) as a path, or None where there is none."""
    return shutil.which(os.environ.get(COMPILER_ENV) or "c++")


def compile_flags() -> list[str]:
    """Flags of the build: optimisation, torch's C++ ABI, OpenMP for ``at::parallel_for``, the CPU's vector ISA.
    No FMA contraction, so products round as the eager map's separate multiplies and adds do."""
    flags = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-w"]
    flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    return flags + CAPABILITY_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])


def compile_command(output: Path, cxx: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    torch_lib = library_paths()[0]
    includes = [f"-I{path}" for path in include_paths()]
    return [cxx, *compile_flags(), *includes, *map(str, SOURCES), f"-L{torch_lib}", "-lc10", "-ltorch_cpu",
            f"-Wl,-rpath,{torch_lib}", "-o", str(output)]  # fmt: skip


def kernel_path() -> Path:
    """Where these sources' build for this torch and CPU lives: the name hashes the sources, torch's version and the
    flags, so a change of any builds anew instead of loading a library built against another ABI."""
    sources = b"".join(source.read_bytes() for source in SOURCES)
    key = hashlib.sha256(sources + repr((torch.__version__, compile_flags())).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"qkmap_cpu_kernels-{key}.so"


def build_fused_kernel(path: Path | None = None) -> Path:
    """Compile the kernel into ``path`` (default ``kernel_path()``), atomically: a failed or killed build leaves no
    file that looks complete. Raises ``KernelBuildError`` naming the compiler's first error."""
    path = kernel_path() if path is None else Path(path)
    cxx = compiler()
    if cxx is None:
        asked = os.environ.get(COMPILER_ENV)
        where = f"{COMPILER_ENV}={asked!r} is not a program" if asked else "c++ is not on PATH"
        raise KernelBuildError(
            f"no C++ compiler found ({where}): install g++ (Debian: apt-get install g++) or set {COMPILER_ENV} to build "
            "the fused CPU kernels; the eager feature map and sdpa with padded values run meanwhile."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as staging:
        try:
            result = subprocess.run(
                compile_command(staging, cxx), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
            )
        except subprocess.TimeoutExpired as error:
            raise KernelBuildError(f"{cxx} did not finish building the fused kernels in {BUILD_TIMEOUT_S} s") from error
        if result.returncode != 0:
            errors = [line for line in result.stderr.splitlines() if "error" in line] or result.stderr.splitlines()
            first = errors[0].strip() if errors else f"exit status {result.returncode}"
            raise KernelBuildError(f"{cxx} failed to build the fused kernels: {first}")
    return path


def unsafe_to_load(path: Path) -> str | None:
    """Why loading ``path`` would run code someone else could have put there, or None. Loading a library runs it,
    so (as ssh does with its keys) a build is loaded only when it and its folder belong to this user and no one
    else may write to them: ``$QKMAP_HF_CACHE`` may point at a shared folder."""
    for item in (path, path.parent):
        info = item.stat()
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            return f"{item} belongs to another user (uid {info.st_uid})"
        if info.st_mode & 0o022:
            return f"{item} is writable by other users (mode {info.st_mode & 0o777:o})"
    return None


def fused_kernel_loaded() -> bool:
    """Whether ``torch.ops.qkmap_v1``'s ops are registered in this process (the model files' own checks)."""
    return FUSED_OPS() is not None and FUSED_ATTENTION_OPS() is not None


def load_fused_kernel(build: bool = False) -> KernelStatus:
    """Register the fused CPU kernels in this process, from this machine's build; with ``build``, compile it
    first where it is missing. Never raises for a missing compiler or a failed build: that is a ``KernelStatus``
    whose ``reason`` says why (with ``build``, also a warning), and the eager map runs."""
    try:
        path = kernel_path()
    except ValueError as error:  # no cache to load from ($QKMAP_HF_CACHE empty or relative): never the cwd
        warnings.warn(str(error), RuntimeWarning, stacklevel=2)
        return KernelStatus(False, None, str(error))
    if fused_kernel_loaded():
        return KernelStatus(True, path)
    seconds = None
    if not path.is_file():
        if not build:
            return KernelStatus(False, path, "not built on this machine yet: run `qkmap kernels`")
        start = time.perf_counter()
        try:
            build_fused_kernel(path)
        except KernelBuildError as error:
            warnings.warn(f"{error}", RuntimeWarning, stacklevel=2)
            return KernelStatus(False, path, str(error))
        seconds = time.perf_counter() - start
    unsafe = unsafe_to_load(path)
    if unsafe:
        reason = f"not loading {path.name}: {unsafe}; remove it and run `qkmap kernels` to build your own"
        warnings.warn(reason, RuntimeWarning, stacklevel=2)
        return KernelStatus(False, path, reason)
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as error:
        reason = f"{path} did not load ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        warnings.warn(f"{reason}; remove it and run `qkmap kernels` to build it again", RuntimeWarning, stacklevel=2)
        return KernelStatus(False, path, reason)
    loaded = fused_kernel_loaded()
    return KernelStatus(loaded, path, "" if loaded else "no ops registered", seconds)


def check_fused_kernel(seed: int = 0) -> float:
    """The fused kernels against their references on random inputs: the feature map against the eager map (GQA, two
    frequency blocks, per-channel and shared omega, rotated and unrotated cos blocks, a batched RoPE table; the
    features and the gradients of ``z``, omega and the gains) and the attention against sdpa in float64 (GQA, keys
    twice the values' width, lengths that are not multiples of its blocks; output and every gradient). The largest
    difference, relative to each reference's largest value. Needs the kernels loaded."""
    if not fused_kernel_loaded():
        raise RuntimeError("the fused CPU kernels are not loaded: load_fused_kernel(build=True) first")
    from ..modeling import feature_map_qkmap as feature_map

    generator = torch.Generator().manual_seed(seed)
    worst = 0.0
    for heads, kv_heads, num_freq, m, freq_width, rotate in ((6, 2, 2, 12, 12, True), (4, 4, 1, 40, 1, False)):
        z = torch.randn(2, 9, heads, m, generator=generator).transpose(1, 2)
        frequency = torch.rand(kv_heads, num_freq, freq_width, generator=generator) * 3 + 0.1
        gain = torch.randn(kv_heads, 2 * num_freq, m, generator=generator)
        cos, sin = torch.randn(2, 2, 9, m, generator=generator)
        grad = torch.randn(2, heads, 9, 2 * num_freq * m, generator=generator)
        needs = (True, True, True, False, False)
        eager = (feature_map._features(z, frequency, gain, cos, sin, rotate),
                 *feature_map._feature_gradients(grad, z, frequency, gain, cos, sin, rotate, needs)[:3])  # fmt: skip
        fused = (feature_map._fused_features(z, frequency, gain, cos, sin, rotate),
                 *feature_map._fused_gradients(grad, z, frequency, gain, cos, sin, rotate, needs[:3])[:3])  # fmt: skip
        worst = max(worst, largest_relative_difference(fused, eager))
    for shape in ((2, 6, 2, 77, 32, 16), (1, 2, 2, 300, 128, 64)):
        worst = max(worst, largest_relative_difference(*attention_against_sdpa(*shape, generator=generator)))
    return worst


def largest_relative_difference(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> float:
    """max over pairs of ``|got - want|.max() / |want|.max()``."""
    return max(
        ((g.double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30)).item()
        for g, w in zip(got, want, strict=True)
    )


def attention_against_sdpa(
    batch: int, heads: int, kv_heads: int, length: int, key_width: int, value_width: int, generator=None
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """``qkmap_v1.causal_attention`` on random float32 inputs (token-major, as the model feeds it) and causal sdpa
    in float64 on the same values: (output, grad query, grad key, grad value) of each, the output as
    ``(batch, heads, T, value_width)``."""
    from ..modeling.attention_qkmap import FusedCausalAttention

    def token_major(heads_: int, width: int) -> torch.Tensor:
        return torch.randn(batch, length, heads_, width, generator=generator).transpose(1, 2)

    inputs = (token_major(heads, key_width), token_major(kv_heads, key_width), token_major(kv_heads, value_width))
    scale = key_width**-0.5
    fused_inputs = [tensor.clone().requires_grad_() for tensor in inputs]
    reference_inputs = [tensor.double().requires_grad_() for tensor in inputs]
    fused = FusedCausalAttention.apply(*fused_inputs, scale).transpose(1, 2)
    reference = torch.nn.functional.scaled_dot_product_attention(
        *reference_inputs, is_causal=True, scale=scale, enable_gqa=True
    )
    grad = torch.randn(reference.shape, generator=generator, dtype=torch.float64)
    fused.backward(grad.float())
    reference.backward(grad)
    got = (fused.detach(), *(tensor.grad for tensor in fused_inputs))
    return got, (reference.detach(), *(tensor.grad for tensor in reference_inputs))


__all__ = [
    "KernelBuildError",
    "attention_against_sdpa",
    "KernelStatus",
    "build_fused_kernel",
    "check_fused_kernel",
    "fused_kernel_loaded",
    "kernel_path",
    "load_fused_kernel",
]
