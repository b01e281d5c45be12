"""``get_kernel_stats_tool``, which tokamax imports but flash3-bench never uses."""


class _KernelStatsTool:
  """Fails loudly if anything tries xprof timing through this stand-in."""

  @staticmethod
  def compute_kernel_stats(*args, **kwargs):
    del args, kwargs
    raise NotImplementedError(
        "xprof is not installed; this is flash3's import stand-in "
        "(scripts/tokamax_shim). Time with CUPTI instead.")


get_kernel_stats_tool = _KernelStatsTool()
