"""tests/_browser.py: headless Chromium renders a local page (its DOM, after scripts run, and a
PNG screenshot), and artifact_dir honours ``PAVEJAX_TEST_ARTIFACTS``."""

import pytest

from tests._browser import (
    PNG_SIGNATURE,
    artifact_dir,
    chromium_path,
    dump_dom,
    require_or_skip,
    screenshot,
)

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>docks</title></head>
<body><table id="docks">
<tr><th>name</th><th>epsilon</th></tr>
<tr><td>alpha-dock</td><td>1.25</td></tr>
</table>
<script>
const row = document.getElementById("docks").insertRow();
row.insertCell().textContent = "scripted-dock";
row.insertCell().textContent = "2.5";
</script></body></html>
"""


@pytest.fixture
def page_url(tmp_path):
    if chromium_path() is None:
        require_or_skip("no Chromium (Debian package 'chromium')")
    page = tmp_path / "page.html"
    page.write_text(PAGE, encoding="utf-8")
    return page.as_uri()


def test_dump_dom_has_the_table_cells_and_script_output(page_url):
    dom = dump_dom(page_url)
    assert "<td>alpha-dock</td>" in dom and "<td>1.25</td>" in dom
    assert "<td>scripted-dock</td><td>2.5</td>" in dom  # the DOM after scripts, not the file


def test_screenshot_is_a_png(page_url, tmp_path):
    path = screenshot(page_url, tmp_path / "shots" / "page.png", size=(640, 480))
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    width, height = (int.from_bytes(path.read_bytes()[at:at + 4], "big") for at in (16, 20))
    assert (width, height) == (640, 480)


def test_artifact_dir_honours_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PAVEJAX_TEST_ARTIFACTS", str(tmp_path / "arts"))
    assert artifact_dir() == tmp_path / "arts" and (tmp_path / "arts").is_dir()
    monkeypatch.delenv("PAVEJAX_TEST_ARTIFACTS")
    assert artifact_dir().name == "test-artifacts"
