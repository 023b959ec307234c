"""Accelerators autosp plans for: the public figures of each, per device, from the vendor's data
sheet (named beside each row). Read by ``autosp plan --device`` (memory per device, the step
time the roofline gives: ``Device.step_time``). The solver and the checkpointing pass still weigh
costs with this CPU's balance (``partition._checkpoint.MACHINE_BALANCE``, measured here).

Figures are per GPU: dense bf16 tensor throughput (without sparsity), HBM capacity and bandwidth,
the scale-up link (NVLink, Infinity Fabric) per direction, the scale-out link (one NIC per GPU, as
the vendors' 8-GPU reference systems have) per direction, and the host link (PCIe) per direction.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Device", "DEVICES", "device"]

GB, TB = 10**9, 10**12


@dataclass(frozen=True, slots=True)
class Device:
    """One accelerator's public figures (bytes, bytes/s, flop/s)."""

    name: str
    bf16_flops: float  # dense bf16 tensor flop/s
    hbm_bytes: int
    hbm_bandwidth: float
    intra_node_bandwidth: float  # per GPU, per direction
    inter_node_bandwidth: float  # per GPU, per direction
    host_bandwidth: float  # per GPU, per direction
    per_node: int = 8  # GPUs a node holds (the scale-up domain)
    source: str = ""
    vendor: str = "nvidia"  # whose attention kernels SDPA runs there (``_attention_ops``)

    @property
    def balance(self) -> float:
        """Flops it does in the time it moves one byte of HBM."""
        return self.bf16_flops / self.hbm_bandwidth

    def link_bandwidth(self, ranks: int) -> float:
        """Per-rank bandwidth of a collective among ``ranks`` GPUs: the scale-up link within a
        node, the scale-out link once the group spans nodes."""
        return self.intra_node_bandwidth if ranks <= self.per_node else self.inter_node_bandwidth

    def step_time(
        self,
        flops: float,
        written: float,
        comm_bytes: float,
        ranks: int,
        overhead: float = 0.0,
        host_bytes: float = 0.0,
    ) -> float:
        """The roofline's time for a step per rank: its flops at peak plus the bytes its ops write
        at HBM bandwidth (each op bound by one or the other: the sum bounds the longer of the two
        from above and the time from below), ``overhead`` more for recomputation, its
        collectives' bytes on the link and ``host_bytes`` over the host link (offloaded
        activations' copies out and back), neither overlapped. A bound at 100% of peak; measured
        steps run at a fraction of it (model FLOPs utilisation)."""
        compute = flops / self.bf16_flops + written / self.hbm_bandwidth
        return compute * (1.0 + overhead) + comm_bytes / self.link_bandwidth(ranks) + host_bytes / self.host_bandwidth


DEVICES = {
    # NVIDIA H100 Tensor Core GPU data sheet (SXM): 989 TFLOPS bf16 dense (1,979 with sparsity),
    # 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (both directions), PCIe Gen5 128 GB/s (both);
    # DGX H100: one ConnectX-7 400 Gb/s NIC per GPU
    "h100": Device("h100", 989 * TB, 80 * GB, 3.35 * TB, 450 * GB, 50 * GB, 64 * GB, source="NVIDIA H100 data sheet"),
    # NVIDIA H200 Tensor Core GPU data sheet (SXM): 989 TFLOPS bf16 dense, 141 GB HBM3e at
    # 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s; HGX H200: one 400 Gb/s NIC per GPU
    "h200": Device("h200", 989 * TB, 141 * GB, 4.8 * TB, 450 * GB, 50 * GB, 64 * GB, source="NVIDIA H200 data sheet"),
    # NVIDIA A100 Tensor Core GPU data sheet (SXM 80GB): 312 TFLOPS bf16 dense, 80 GB HBM2e at
    # 2,039 GB/s, NVLink 600 GB/s, PCIe Gen4 64 GB/s; DGX A100: one 200 Gb/s HDR NIC per GPU
    "a100": Device("a100", 312 * TB, 80 * GB, 2.039 * TB, 300 * GB, 25 * GB, 32 * GB, source="NVIDIA A100 data sheet"),
    # NVIDIA HGX B200 (1,000 W), per GPU: 2.25 PFLOPS bf16 dense (4.5 with sparsity); DGX B200 data
    # sheet: 1,440 GB HBM3e at 64 TB/s for 8 GPUs (180 GB, 8 TB/s each), NVLink 5 1.8 TB/s, PCIe
    # Gen5, one 400 Gb/s NIC per GPU
    "b200": Device(
        "b200", 2250 * TB, 180 * GB, 8 * TB, 900 * GB, 50 * GB, 64 * GB, source="NVIDIA DGX/HGX B200 data sheets"
    ),
    # AMD Instinct MI300X data sheet: 1,307.4 TFLOPS bf16 dense, 192 GB HBM3 at 5.3 TB/s, Infinity
    # Fabric 7 links x 128 GB/s (896 GB/s, both directions), PCIe Gen5 x16 128 GB/s; one 400 Gb/s
    # NIC per GPU in the 8-GPU platform
    "mi300x": Device(
        "mi300x",
        1307.4 * TB,
        192 * GB,
        5.3 * TB,
        448 * GB,
        50 * GB,
        64 * GB,
        source="AMD Instinct MI300X data sheet",
        vendor="amd",
    ),
}


def device(name: str) -> Device:
    """The device called ``name`` (case-insensitive), or a ``ValueError`` naming the known ones."""
    found = DEVICES.get(name.lower())
    if found is None:
        raise ValueError(f"autosp: no device {name!r}; known: {', '.join(DEVICES)}")
    return found
