"""In CI a missing browser fails the browser tests instead of skipping them (issue 25)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.explorer_harness import require_chromium, skip_reason


def test_missing_browser_skips_only_outside_ci(tmp_path: Path) -> None:
    missing = tmp_path / "no-chromium"
    assert skip_reason(missing, {}) is not None
    assert skip_reason(missing, {"CI": "true"}) is None
    present = tmp_path / "chromium"
    present.write_text("")
    assert skip_reason(present, {}) is None


def test_require_chromium_fails_without_a_browser(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    import tests.e2e.explorer_harness as harness

    monkeypatch.setattr(harness, "CHROMIUM", tmp_path / "no-chromium")
    with pytest.raises(pytest.fail.Exception, match="missing"):
        require_chromium()
