"""Real GPUs: `kareus gpu reset-clocks`."""

from typing import Annotated

import typer

from kareus.cli.app import app, console

gpu_app = typer.Typer(help="Real GPUs: clocks.", no_args_is_help=True)
app.add_typer(gpu_app, name="gpu")


@gpu_app.command("reset-clocks")
def gpu_reset_clocks(
    gpu_index: Annotated[int, typer.Option("--gpu-index", help="Which GPU.")] = 0,
) -> None:
    """Reset a GPU's locked SM clocks (after a process was killed with SIGKILL)."""
    from kareus.gpu.clock_guard import reset_clocks  # NVML: the gpu extra
    from kareus.gpu.device import ZeusDevice

    reset_clocks(ZeusDevice(gpu_index))
    console.print(f"GPU {gpu_index}: SM clocks reset")
