"""Where the trainer computes and in what precision.

``--device auto`` takes the GPU when there is one (``LOCAL_RANK`` picks it under ``torchrun``), else the CPU.
``--precision auto`` computes in bf16 where the device does it natively (a CUDA device with bf16 support) and
in fp32 on the CPU. Parameters and the AdamW state stay fp32 either way: bf16 is the *compute* dtype (FSDP2's
mixed-precision policy casts the gathered parameters; one process runs under autocast), so small updates are
not lost to bf16 rounding of the weights they are added to.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rollbus.trainer.settings import DeviceChoice, PrecisionChoice


class DeviceError(ValueError):
    """A device or precision this machine cannot give (e.g. ``--device cuda`` without a GPU)."""


@dataclass(frozen=True)
class Placement:
    device: torch.device
    compute_dtype: torch.dtype  # torch.float32 or torch.bfloat16; parameters are float32 regardless

    @property
    def backend(self) -> str:
        """The collective backend for this device: NCCL between GPUs, gloo between CPU processes."""
        return "nccl" if self.device.type == "cuda" else "gloo"

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != torch.float32

    def name(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return "cpu"


def placement(device: DeviceChoice, precision: PrecisionChoice) -> Placement:
    """Resolve ``auto`` choices and refuse what this machine cannot do, with a reason."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError("--device cuda: no CUDA device is available here")
        where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    else:
        where = torch.device("cpu")
    if precision == "auto":
        precision = "bf16" if where.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "bf16" and where.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError("--precision bf16: this CUDA device has no bf16 support")
    return Placement(where, torch.bfloat16 if precision == "bf16" else torch.float32)


@contextlib.contextmanager
def autocast(where: Placement, *, sharded: bool) -> Iterator[None]:
    """bf16 compute for one unsharded process; under FSDP2 the mixed-precision policy already casts."""
    if not where.mixed or sharded:
        yield
        return
    with torch.autocast(where.device.type, dtype=where.compute_dtype):
        yield
