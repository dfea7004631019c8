"""labkit.yamlload: the pure-Python reader gives what PyYAML gives on every shipped data file and on what
yaml.safe_dump writes; anything outside its subset is a ValueError naming the line; with yaml unimportable,
the theory modules the GPU check needs still read their data."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from labkit import yamlload as Y

ROOT = Path(__file__).resolve().parent.parent
DATA_FILES = sorted(p for p in (ROOT / "data").rglob("*") if p.suffix in (".yaml", ".yml"))


def test_there_are_data_files_to_compare():
    names = {p.name for p in DATA_FILES}
    assert {"models.yaml", "hardware.yaml"} <= names, names


@pytest.mark.parametrize("path", DATA_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_data_file_reads_exactly_as_pyyaml(path):
    text = path.read_text(encoding="utf-8")
    want = yaml.safe_load(text)
    got = Y.loads(text)
    assert got == want
    assert _types(got) == _types(want)  # 1 vs 1.0 vs True: == alone would not tell


def _types(v):
    if isinstance(v, dict):
        return {k: _types(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_types(x) for x in v]
    return type(v).__name__


@pytest.mark.parametrize("text", [
    "a: 1\nb: 1.5\nc: 2.0e-6\nd: 1e-6\ne: 1.0e+5\nf: 1_000\ng: 0x1F\nh: 017\ni: 1:30\nj: -0.5\nk: +3",
    "a: yes\nb: Off\nc: TRUE\nd: ~\ne:\nf: null\ng: 'true'\nh: .inf\ni: -.Inf\nj: 2024-05-01",
    "x: [1, 2, {a: b, c: [d, e]}]\ny: {}\nz: []\nw: {k: v,\n  k2: [1,\n   2]}",
    "- a\n- b: 1\n  c: 2\n- - x\n  - y\n-\n  - z\n- {value: 0, why: \"x: y\"}",
    "k:\n- 1\n- 2\nl: 3",
    "a: 'it''s'\nb: \"tab\\tu\\u00e9 \\\"q\\\"\"\nc: 'a #not' # a comment\n# a line comment\nd: https://x.org/a#b",
    "a: plain text\n  continued here\nb: 'quoted\n  over lines '\nc: \"double\n\n  with a blank line\"",
    "---\ntop:\n  nested:\n    deeper: [1f1b, zb-h1]\n",
    "", "# only a comment\n", "just a scalar", "[1, 2]",
])
def test_the_subset_reads_as_pyyaml(text):
    assert Y.loads(text) == yaml.safe_load(text)


_text = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF, exclude_categories=("Cc",)), max_size=90)
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-10**15, 10**15), st.floats(allow_nan=False, width=64), _text)
_key = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12)
_doc = st.recursive(_scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(_key, inner, max_size=4)), max_leaves=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=st.dictionaries(_key, _doc, min_size=1, max_size=5), flow=st.sampled_from([False, True, None]),
       width=st.sampled_from([40, 80]))
def test_what_safe_dump_writes_reads_back_as_pyyaml_reads_it(doc, flow, width):
    text = yaml.safe_dump(doc, default_flow_style=flow, width=width, allow_unicode=True)
    assert Y.loads(text) == yaml.safe_load(text)


def test_a_nan_reads_as_nan():
    assert math.isnan(Y.loads("a: .nan")["a"])


@pytest.mark.parametrize("text, match", [
    ("a: &x 1\nb: *x", "line 1: '&'"), ("a: !!str 1", "line 1: '!'"), ("a: |\n  x", "line 1: '\\|'"),
    ("a: >\n  x", "line 1: '>'"), ("\ta: 1", "line 1: a tab"), ("a: 1\n---\nb: 2", "line 2: a second YAML document"),
    ("a: [1, 2", "line 1: expected ','"), ("a: 'x", "unterminated"), ("a: 1\n  b: 2", "line 2"),
    ("a:\n  - 1\n  b: 2", "line 3"), ("a: 1\nb: x\x85y", "line 2: line break"),
    ("a: 2024-05-01 10:00:00", "timestamp"), ("a: \"\\q\"", "unknown escape"),
])
def test_outside_the_subset_is_a_value_error_naming_the_line(text, match):
    with pytest.raises(ValueError, match=match):
        Y.loads(text)


def test_load_path_names_the_file_without_pyyaml(tmp_path, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: &anchor 1\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    assert not Y.have_pyyaml()
    with pytest.raises(ValueError, match="bad.yaml: line 1"):
        Y.load_path(bad)
    assert Y.load_path(ROOT / "data" / "models.yaml") == yaml.safe_load((ROOT / "data" / "models.yaml").read_text())


BLOCK = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {BLOCKED!r}:
            raise ImportError('blocked by the test: ' + name)
sys.meta_path.insert(0, _Block())
"""


def blocked_python(code: str, blocked=("yaml", "pandas", "plotly", "papermill", "ipywidgets", "matplotlib"),
                   timeout=120, **kw) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter where importing any of ``blocked`` raises ImportError."""
    return subprocess.run([sys.executable, "-P", "-c", BLOCK.replace("{BLOCKED!r}", repr(set(blocked))) + code],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, **kw)


def test_theory_reads_its_data_with_yaml_unimportable():
    code = ("from labkit.theory.spec import get_spec; from labkit.theory import memory as mem; "
            "from labkit.theory import costmodel; "
            "print(get_spec('llama-3-8b').hidden_size, mem.get_device('h100-80gb')['peak_bf16_tflops'], "
            "sorted(costmodel._load(str(__import__('labkit.paths').paths.data_dir() / 'hardware.yaml')))[:2])")
    out = blocked_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["4096", "989"]
    assert "ModuleNotFoundError" not in out.stderr and "yaml" not in out.stdout
