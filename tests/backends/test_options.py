"""A backend kind's options are declared on its spec's fields (kareus.backends.options)."""

from kareus.backends.emulator.spec import EmulatorSpec
from kareus.backends.nvml import FakeGpuSpec, NvmlSpec
from kareus.backends.options import MAX_SEED, flag_of, spec_options
from kareus.core import MeasurementProtocol


def test_a_specs_options_are_its_fields_with_flags_base_first():
    opts = list(spec_options(EmulatorSpec))
    assert [o.flag.flag for o in opts] == ["--seed", "--window", "--cooldown", "--settle",
                                           "--noise", "--calibration"]
    seed = opts[0]
    assert (seed.field, seed.default, seed.flag.at_most) == ("seed", 0, MAX_SEED)
    window = opts[1]
    assert (window.field, window.part, window.of) == ("protocol", "window_s",
                                                      MeasurementProtocol)
    assert window.flag.positive and window.default is None


def test_a_subclass_shares_its_bases_options():
    assert list(spec_options(FakeGpuSpec)) == list(spec_options(NvmlSpec))
    assert flag_of(NvmlSpec, "runtime") == "--runtime"
    assert flag_of(NvmlSpec, "protocol") == "--window/--cooldown/--settle"
    assert flag_of(NvmlSpec, "torch_device") == "--torch-device"  # no option: its name
