"""examples/: importable without torch; moe_block.py runs on the cpu backend wherever torch imports."""
import importlib.util
import os

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "moe_block.py")


def load():
    spec = importlib.util.spec_from_file_location("moe_block_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_imports_without_torch():
    assert callable(load().main)


def test_example_matches_the_pytorch_block_on_the_cpu_backend(capsys):
    pytest.importorskip("torch", reason="torch is not installed: the example needs torch")
    assert load().main(["--backend", "cpu", "--tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "backend=cpu" in out and "rel L2 difference" in out
