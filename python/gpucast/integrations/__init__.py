"""Framework callbacks: gpucast.integrations.lightning.GpucastCallback, gpucast.integrations.transformers.GpucastCallback."""
