"""The package declares its license, and ships the text it declares."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _project():
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def test_license_text_is_the_declared_license():
    project = _project()
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    head = " ".join(text.split()[:4])
    assert head == "Apache License Version 2.0,", head
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_installed_metadata_names_the_license_file():
    try:
        meta = importlib.metadata.metadata("impala_rep")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("impala_rep is not installed (scripts/setup.sh installs it)")
    assert meta["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in (meta.get_all("License-File") or [])
