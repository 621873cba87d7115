"""System figures sent with the rows as they are written: rank 0's node's CPU and memory, and its
GPUs' utilisation and memory where NVML sees them."""

from __future__ import annotations

from typing import Any


class SystemFigures:
    """CPU and host memory (psutil), GPU utilisation and memory (NVML, when pynvml is importable and
    sees a GPU) of rank 0's node: sampled at most once per poll, under MLflow's system metric names."""

    def __init__(self):
        self.nvml: Any = None  # the pynvml module, when it loads and sees a GPU
        self.gpus = 0
        self.cached: dict | None = None

    def start(self) -> None:
        import psutil

        psutil.cpu_percent(None)  # the first call starts the interval the next one measures
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.gpus = pynvml, pynvml.nvmlDeviceGetCount()
        except Exception:  # no pynvml, no driver, no GPU: CPU figures only
            self.nvml = None

    def forget(self) -> None:
        self.cached = None

    def sample(self) -> dict:
        if self.cached is None:
            import psutil

            memory = psutil.virtual_memory()
            figures = {
                "system/cpu_utilization_percentage": psutil.cpu_percent(None),
                "system/system_memory_usage_percentage": memory.percent,
                "system/system_memory_usage_megabytes": memory.used / 2**20,
            }
            for i in range(self.gpus):
                gpu = self.nvml.nvmlDeviceGetHandleByIndex(i)
                figures[f"system/gpu_{i}_utilization_percentage"] = self.nvml.nvmlDeviceGetUtilizationRates(gpu).gpu
                figures[f"system/gpu_{i}_memory_usage_megabytes"] = self.nvml.nvmlDeviceGetMemoryInfo(gpu).used / 2**20
            self.cached = figures
        return self.cached
