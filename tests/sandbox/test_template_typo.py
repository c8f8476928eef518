"""A template name with a typo is answered with the closest built one."""

from __future__ import annotations

from pathlib import Path

import pytest

from torpor.errors import TemplateNotFound
from torpor.sandbox import template as templates


def test_a_typo_suggests_the_closest_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORPOR_HOME", str(tmp_path))
    for name in ("python", "python-2g", "node"):
        (tmp_path / "templates" / name).mkdir(parents=True)
        (tmp_path / "templates" / name / "template.json").write_text("{}")
    with pytest.raises(TemplateNotFound) as err:
        templates.get("pyton")
    assert "did you mean 'python'?" in str(err.value)
    with pytest.raises(TemplateNotFound) as err:
        templates.get("rust")  # nothing close: say how to build it
    assert "torpor template build rust" in str(err.value) and "did you mean" not in str(err.value)
