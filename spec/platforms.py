"""The platform facts that decide a hybrid model's KV-cache block size in vLLM 0.33.

vLLM picks the attention block size after the model is built, from the attention backend the
platform selects (``Platform.update_block_size_for_backend``, ``platforms/interface.py``; the CPU
platform overrides it in ``platforms/cpu.py``). The facts that matter for geometry are few and
are written down here as values, so a layout derived for one platform names the facts it used:

- ``default_block_size``: the block size when the user gives none (CUDA: the backend accepts
  vLLM's default 16; CPU: the CPU backend is asked for 128, ``cpu.py``).
- ``kernel_block_base``: the smallest block the attention kernels run (FLASH_ATTN, TRITON_ATTN
  and FlashInfer on sm90 advertise multiples of 16; CPU_ATTN multiples of 32).
- ``gdn_checkpoint_alignment``: in align mode, gated-delta-net layers whose prefill kernel emits
  mid-prefill states make every block a multiple of this (FlashInfer's GDN prefill on sm90:
  64 tokens, ``FLASHINFER_GDN_CHECKPOINT_ALIGNMENT``). 1 where the Triton/FLA kernel is used.
- ``odd_block_size_warns``: a user ``--block-size`` that is not a multiple of
  ``kernel_block_base`` is kept with a warning instead of refused (CPU: ``check_and_update_config``
  logs "CPU backend prefers block_size is multiples of 32"). vLLM then derives the geometry from
  it: a sliding-window layer picks its own kernel block (``_largest_kernel_block_within``,
  ``layers/attention/attention.py``), a hybrid model aligns to ``max(32, block_size)``, and the
  page unification scales the rest, so e.g. 16 ends as 32 for gpt-oss.
- ``fp32_ssm_state``: the CPU platform on a host with AVX-512 BF16 resets an ``auto`` (or 16-bit,
  non-GDN) SSM state dtype to float32 (``cpu.py``, "Reset SSM cache type to float32").
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["DEFAULT_PLATFORM", "PLATFORMS", "Platform"]


@dataclass(frozen=True, slots=True)
class Platform:
    """One platform's alignment facts (see the module docstring for each field's source)."""

    name: str
    description: str
    default_block_size: int
    kernel_block_base: int
    gdn_checkpoint_alignment: int
    fp32_ssm_state: bool
    odd_block_size_warns: bool


_CUDA_SM90 = Platform(
    name="cuda-sm90",
    description="NVIDIA Hopper (H100/H200), CUDA: FLASH_ATTN kernels, FlashInfer GDN prefill",
    default_block_size=16,
    kernel_block_base=16,
    gdn_checkpoint_alignment=64,
    fp32_ssm_state=False,
    odd_block_size_warns=False,
)
_CPU = Platform(
    name="cpu",
    description="vLLM's CpuPlatform on a host without AVX-512 BF16: CPU_ATTN kernels",
    default_block_size=128,
    kernel_block_base=32,
    gdn_checkpoint_alignment=1,
    fp32_ssm_state=False,
    odd_block_size_warns=True,
)
_CPU_AVX512BF16 = Platform(
    name="cpu-avx512bf16",
    description="vLLM's CpuPlatform on a host with AVX-512 BF16: SSM state kept in float32",
    default_block_size=128,
    kernel_block_base=32,
    gdn_checkpoint_alignment=1,
    fp32_ssm_state=True,
    odd_block_size_warns=True,
)

#: Every platform the layout model knows, by name (read-only).
PLATFORMS = MappingProxyType({p.name: p for p in (_CUDA_SM90, _CPU, _CPU_AVX512BF16)})

#: The platform a layout is derived for when none is named: an H100-class GPU.
DEFAULT_PLATFORM = _CUDA_SM90.name
