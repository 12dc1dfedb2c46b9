"""The environment is read once, into checked settings; `reload()` reads it again."""

from __future__ import annotations

import pytest

from moe_ep.ops import settings as settings_module
from moe_ep.ops.settings import Settings, reload, settings


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch: pytest.MonkeyPatch):
    for name in ("MOE_EP_TIMEOUT_S", "MOE_EP_INIT_TIMEOUT_S", "MOE_EP_CHECK_VALUES", "MOE_EP_LOW_LATENCY_TRANSPORT"):
        monkeypatch.delenv(name, raising=False)
    yield
    monkeypatch.undo()
    reload()  # the next tests see the real environment again


def test_defaults_without_variables() -> None:
    assert reload() == Settings(timeout_s=100.0, init_timeout_s=600.0, check_values=True, low_latency_transport="auto")


def test_values_are_read_once_until_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    reload()
    monkeypatch.setenv("MOE_EP_TIMEOUT_S", "2.5")
    monkeypatch.setenv("MOE_EP_INIT_TIMEOUT_S", "30")
    monkeypatch.setenv("MOE_EP_CHECK_VALUES", "0")
    monkeypatch.setenv("MOE_EP_LOW_LATENCY_TRANSPORT", "nvshmem_puts")
    assert settings().timeout_s == 100.0  # not read again on use
    assert reload() == Settings(timeout_s=2.5, init_timeout_s=30.0, check_values=False,
                                low_latency_transport="nvshmem_puts")
    assert settings() is settings()


@pytest.mark.parametrize("name, value", [
    ("MOE_EP_TIMEOUT_S", "ten"), ("MOE_EP_TIMEOUT_S", "0"), ("MOE_EP_TIMEOUT_S", "-3"), ("MOE_EP_TIMEOUT_S", "inf"),
    ("MOE_EP_INIT_TIMEOUT_S", "0"),
    ("MOE_EP_CHECK_VALUES", "no"), ("MOE_EP_CHECK_VALUES", ""), ("MOE_EP_LOW_LATENCY_TRANSPORT", "ibgda"),
])
def test_a_malformed_value_names_its_variable_and_keeps_the_settings(monkeypatch: pytest.MonkeyPatch, name: str,
                                                                     value: str) -> None:
    before = reload()
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"^{name}: expected .*got {value!r}"):
        reload()
    assert settings() is before


def test_value_checks_follow_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from moe_ep.ops.validation import check_topk_values

    repeated = torch.tensor([[1, 1]])
    with pytest.raises(ValueError, match="same expert more than once"):
        check_topk_values("topk_idx", repeated, 4)
    monkeypatch.setenv("MOE_EP_CHECK_VALUES", "0")
    reload()
    check_topk_values("topk_idx", repeated, 4)  # skipped, as DeepEP does no such check


def test_no_module_reads_the_environment_outside_settings() -> None:
    """The one reader: other modules ask `settings()` (the launcher and NVSHMEM's setup excepted)."""
    import pathlib
    import re

    package = pathlib.Path(settings_module.__file__).parents[1]
    allowed = {"ops/settings.py", "launch.py", "ops/backends/cuda_low_latency.py"}
    readers = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                     if re.search(r"os\.environ|getenv", path.read_text()))
    assert set(readers) <= allowed, readers
