"""``--device`` is checked before anything loads: a clear error, never torch's traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dart_client.devices import check_device
from dart_client.errors import InvalidArgumentError


def test_existing_devices_pass_through() -> None:
    assert check_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert check_device("cuda:0") == torch.device("cuda", 0)


@pytest.mark.parametrize("spec", ["bogus", "cuda:x", ""])
def test_unknown_device_strings_are_named(spec: str) -> None:
    with pytest.raises(InvalidArgumentError, match="unknown device"):
        check_device(spec)


def test_a_missing_gpu_is_named() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    wanted = f"cuda:{count}"  # one past the last GPU (cuda:0 on a machine without one)
    with pytest.raises(InvalidArgumentError, match=wanted):
        check_device(wanted)


def test_commands_reject_a_bad_device_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dart_client.apps.cli import main as dart_main
    from dart_client.apps.train import regenerate_main, train_main

    out = tmp_path / "regen.jsonl"
    assert regenerate_main(["--output", str(out), "--device", "bogus"]) == 2
    assert "unknown device 'bogus'" in capsys.readouterr().err
    assert not out.exists()
    assert train_main(["--output-dir", str(tmp_path / "run"), "--device", "bogus"]) == 2
    assert "unknown device 'bogus'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert dart_main(["generate", "--device", "bogus", "hello"]) != 0
    assert "unknown device 'bogus'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "module",
    ["cli", "batched", "step_profile", "gpu_shapes"],
)
def test_benchmarks_reject_a_bad_device_before_loading(
    module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib

    main = importlib.import_module(f"dart_client.apps.bench.{module}").main
    with pytest.raises(SystemExit) as exited:
        main(["--device", "cuda:99"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "device 'cuda:99'" in err and "Traceback" not in err, err
