"""The tutorial notebooks run top to bottom (with their ``TINY`` smoke settings) in a Jupyter
kernel of this interpreter, registered in a temporary Jupyter path."""

import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = {p.stem: p for p in sorted((ROOT / "notebooks").glob("*.ipynb"))}
KERNEL = "pavejax-tests"
# what each notebook must print when it worked (its own asserts guard the numbers)
EXPECTED = {
    "01_quickstart": ["merge + PACZero-ZPL", "0.0 nats", "cosine"],
    "02_pave_privacy": ["replace_one", "conditional epsilon", "refused:", "broken: noise / 10"],
    "03_paczero": ["ZPL released 0 nats", "mezo", "dpzo"],
    "04_dp_merging": ["would claim", "all digits"],
    "05_paczero_lm": ["calibrated on dev", "ZPL released 0.0 nats", "greedy:", "<|im_start|>"],
}


def test_the_notebooks_exist_clean_with_a_parameter_cell():
    assert sorted(NOTEBOOKS) == sorted(EXPECTED)
    for name, path in NOTEBOOKS.items():
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(params) == 1 and "SMALL = True" in params[0].source, name
        assert "TINY = False" in params[0].source, name
        for cell in nb.cells:  # stored without outputs: the tests and readers run them
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, name
            assert "/work" not in cell.source and "/root" not in cell.source, name


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A kernelspec for ``sys.executable`` in a temporary Jupyter path; the kernel imports the
    package from this checkout."""
    from ipykernel.kernelspec import write_kernel_spec

    home = tmp_path_factory.mktemp("jupyter")
    write_kernel_spec(home / "kernels" / KERNEL,
                      overrides={"display_name": "pavejax tests", "argv": [
                          sys.executable, "-m", "ipykernel_launcher", "-f",
                          "{connection_file}"]})
    env = {"JUPYTER_PATH": str(home), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
           "JUPYTER_PLATFORM_DIRS": "1", "IPYTHONDIR": str(home / "ipython"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        yield KERNEL


def _run(name: str, kernel: str, cwd: Path) -> str:
    nb = nbformat.read(NOTEBOOKS[name], as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    params.source += "\nTINY = True  # set by the test suite\n"
    nbclient.NotebookClient(nb, kernel_name=kernel, timeout=600,
                            resources={"metadata": {"path": str(cwd)}}).execute()
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            out.append(o.get("text", "") if o.get("output_type") == "stream" else
                       str(o.get("data", {}).get("text/plain", "")))
    return "".join(out)


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param("01_quickstart", marks=pytest.mark.assets),
    "02_pave_privacy", "03_paczero", "04_dp_merging",
    pytest.param("05_paczero_lm", marks=pytest.mark.assets)])
def test_notebook_runs_top_to_bottom(name, kernel, tmp_path):
    text = _run(name, kernel, tmp_path)
    for phrase in EXPECTED[name]:
        assert phrase in text, f"{name} did not print {phrase!r}"
    assert "Traceback" not in text
    assert list(tmp_path.iterdir()) == []  # nothing left behind in the working directory
