"""The lab's data files (data/*.yaml) read with PyYAML where it is installed, else with a pure-Python reader.

``python3 -m labkit.gpu_check`` runs on a lent GPU machine with nothing but its own python3 and CUDA torch:
no PyYAML. :func:`load_path` reads a YAML file with PyYAML's safe loader when ``import yaml`` works (libyaml's
``CSafeLoader`` when built) and otherwise with :func:`loads`, a reader for the subset of YAML the data files
use, giving what PyYAML's ``safe_load`` gives on them (tests/test_yamlload.py compares every shipped file):

* block mappings (``key: value``) and block sequences (``- item``, items that are mappings included);
* flow mappings and sequences (``{a: 1, b: [x, y]}``), on one line or across several;
* scalars: plain, "double-quoted" (with backslash escapes) and 'single-quoted', a plain or quoted one folded
  over continuation lines; resolved as PyYAML resolves YAML 1.1 plain scalars (its ``Resolver``): null
  (``~``, ``null``, empty), bool (``true``/``false``/``yes``/``no``/``on``/``off`` in three cases), int
  (decimal, ``0x``, ``0b``, ``0``-octal, ``_`` separators, sexagesimal), float (a ``.`` is required; an
  exponent needs its sign: ``2.0e-6`` is a float, ``1e-6`` a string — as in PyYAML), ``.inf``, ``.nan``,
  dates (``2024-05-01``); comments (``#`` after whitespace), a leading ``---``, ``\n`` or ``\r\n`` line breaks.

Anything else — anchors and aliases, tags, ``|`` / ``>`` block scalars, complex keys, several documents,
tab indentation — raises ValueError naming the line, never a silent misreading. Source: the YAML 1.1
specification (https://yaml.org/spec/1.1/) and PyYAML's resolver (https://github.com/yaml/pyyaml,
``lib/yaml/resolver.py``), whose regular expressions :data:`_INT`, :data:`_FLOAT`, :data:`_BOOL` and
:data:`_NULL` restate.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any

__all__ = ["load_path", "loads", "have_pyyaml"]

_BOOL = re.compile(r"^(?:yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF)$")
_TRUE = {"yes", "true", "on"}
_NULL = re.compile(r"^(?:~|null|Null|NULL|)$")
_INT = re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+"
                  r"|[-+]?[1-9][0-9_]*(?::[0-5]?[0-9])+)$")
_FLOAT = re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
                    r"|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
_WS = " \t"  # YAML white space (str.strip alone would also take \xa0 and other Unicode spaces)
_DATE = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")
_TIMESTAMP = re.compile(r"^[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}(?:[Tt]|[ \t]+)[0-9]")
_ESCAPES = {"0": "\0", "a": "\a", "b": "\b", "t": "\t", "\t": "\t", "n": "\n", "v": "\v", "f": "\f", "r": "\r",
            "e": "\x1b", " ": " ", '"': '"', "/": "/", "\\": "\\", "N": "\x85", "_": "\xa0", "L": "\u2028",
            "P": "\u2029"}
_HEX = {"x": 2, "u": 4, "U": 8}


def have_pyyaml() -> bool:
    """Whether ``import yaml`` works in this interpreter."""
    try:
        import yaml  # noqa: F401
    except ImportError:
        return False
    return True


def load_path(path: str | Path) -> Any:
    """The YAML document in the file ``path`` (UTF-8): PyYAML's safe loader when importable, else
    :func:`loads`. Raises OSError for an unreadable file and ValueError (PyYAML: ``yaml.YAMLError``) for one
    that is not YAML (or, without PyYAML, not of the supported subset)."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        import yaml
    except ImportError:
        try:
            return loads(text)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


# ------------------------------------------------------------------------------------------------------
# scalars
# ------------------------------------------------------------------------------------------------------
def _int(s: str) -> int:
    s = s.replace("_", "")
    sign = -1 if s[0] == "-" else 1
    s = s.lstrip("+-")
    if s == "0":
        return 0
    if s.startswith("0b"):
        return sign * int(s[2:], 2)
    if s.startswith("0x"):
        return sign * int(s[2:], 16)
    if s.startswith("0"):
        return sign * int(s, 8)
    if ":" in s:
        value = 0
        for part in s.split(":"):
            value = value * 60 + int(part)
        return sign * value
    return sign * int(s)


def _float(s: str) -> float:
    s = s.replace("_", "").lower()
    sign = -1.0 if s[0] == "-" else 1.0
    s = s.lstrip("+-")
    if s == ".inf":
        return sign * float("inf")
    if s == ".nan":
        return float("nan")
    if ":" in s:
        value = 0.0
        for part in s.split(":"):
            value = value * 60 + float(part)
        return sign * value
    return sign * float(s)


def _plain(s: str, where: str) -> Any:
    """A plain scalar resolved as PyYAML's SafeLoader resolves it."""
    if _NULL.match(s):
        return None
    if _BOOL.match(s):
        return s.lower() in _TRUE
    if _INT.match(s):
        return _int(s)
    if _FLOAT.match(s):
        return _float(s)
    if _DATE.match(s):
        return datetime.date.fromisoformat(s)
    if _TIMESTAMP.match(s):
        raise ValueError(f"{where}: timestamp {s!r} is outside the YAML subset this reader takes (quote it)")
    if s[0] in "&*!|>%@`" or s.startswith(("- ", ": ", "? ")) or s in ("-", "?", ":"):
        raise ValueError(f"{where}: {s!r} uses a YAML feature this reader does not take (anchors, aliases, "
                         "tags, block scalars, complex keys); quote the value")
    return s


def _double(body: str, where: str) -> str:
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        if i + 1 >= len(body):
            raise ValueError(f"{where}: a backslash ends the double-quoted string")
        e = body[i + 1]
        if e in _HEX:
            n = _HEX[e]
            digits = body[i + 2 : i + 2 + n]
            if len(digits) != n or not all(ch in "0123456789abcdefABCDEF" for ch in digits):
                raise ValueError(f"{where}: bad escape \\{e}{digits}")
            out.append(chr(int(digits, 16)))
            i += 2 + n
        elif e in _ESCAPES:
            out.append(_ESCAPES[e])
            i += 2
        else:
            raise ValueError(f"{where}: unknown escape \\{e} in a double-quoted string")
    return "".join(out)


def _quoted_end(text: str, start: int, where: str) -> int:
    """Index just past the closing quote of the quoted scalar opening at ``text[start]``."""
    q = text[start]
    i = start + 1
    while i < len(text):
        if q == '"' and text[i] == "\\":
            i += 2
            continue
        if text[i] == q:
            if q == "'" and text[i + 1 : i + 2] == "'":
                i += 2
                continue
            return i + 1
        i += 1
    raise ValueError(f"{where}: unterminated {q}-quoted string")


def _quoted(token: str, where: str) -> str:
    if token[0] == '"':
        return _double(token[1:-1], where)
    return token[1:-1].replace("''", "'")


def _fold_quoted(body: str) -> str:
    """A quoted scalar's body over several lines: white space around each line break is dropped, then the
    lines fold as :func:`_fold` folds them (a one-line body is kept exactly)."""
    parts = body.split("\n")
    if len(parts) == 1:
        return body
    parts = [parts[0].rstrip(" \t")] + [p.strip(" \t") for p in parts[1:-1]] + [parts[-1].lstrip(" \t")]
    return _fold(parts)


def _fold(parts: list[str]) -> str:
    """Continuation lines of a flow scalar: each line break becomes a space, an empty line a newline."""
    out = parts[0]
    for p in parts[1:]:
        if p == "":
            out += "\n"
        elif out.endswith("\n") or out == "":
            out += p
        else:
            out += " " + p
    return out


# ------------------------------------------------------------------------------------------------------
# lines, comments
# ------------------------------------------------------------------------------------------------------
def _strip_comment(line: str) -> str:
    """``line`` without its comment (``#`` at the start or after whitespace, outside quotes)."""
    i, n = 0, len(line)
    while i < n:
        c = line[i]
        if c in "\"'" and (i == 0 or line[i - 1] in " \t[{,:-"):
            try:
                i = _quoted_end(line, i, "")
            except ValueError:
                return line.rstrip(_WS)  # a quoted scalar continued on the next line
            continue
        if c == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip(_WS)
        i += 1
    return line.rstrip(_WS)


class _Lines:
    def __init__(self, text: str):
        self.items: list[tuple[int, str, int]] = []  # (indent, content, line number)
        text = text.replace("\r\n", "\n")
        for ch in "\r\x85\u2028\u2029":
            if ch in text:
                no = text[: text.index(ch)].count("\n") + 1
                raise ValueError(f"line {no}: line break {ch!r} is outside the subset this reader takes (\\n, \\r\\n)")
        raw = self.raw = text.split("\n")
        started = False
        for no, line in enumerate(raw, 1):
            body = _strip_comment(line)
            if not body.strip(_WS):
                continue
            stripped = body.lstrip(" ")
            if stripped.startswith("\t") or (body[: len(body) - len(stripped)].count("\t")):
                raise ValueError(f"line {no}: a tab in the indentation (YAML indents with spaces)")
            if stripped.startswith("%"):
                raise ValueError(f"line {no}: a YAML directive is outside the subset this reader takes")
            if stripped.rstrip(_WS) == "---" or stripped.startswith("--- "):
                if started or body != stripped:
                    raise ValueError(f"line {no}: a second YAML document is outside the subset this reader takes")
                started = True
                rest = stripped[3:].strip(_WS)
                if rest:
                    self.items.append((0, rest, no))
                continue
            if stripped.rstrip(_WS) == "...":
                raise ValueError(f"line {no}: a document end marker is outside the subset this reader takes")
            started = True
            self.items.append((len(body) - len(stripped), stripped, no))
        self.i = 0

    def peek(self):
        return self.items[self.i] if self.i < len(self.items) else None


# ------------------------------------------------------------------------------------------------------
# flow collections: [a, b], {k: v}
# ------------------------------------------------------------------------------------------------------
class _Flow:
    def __init__(self, text: str, where: str):
        self.s, self.i, self.where = text, 0, where

    def ws(self):
        while self.i < len(self.s) and self.s[self.i] in " \t\n":
            self.i += 1

    def value(self) -> Any:
        self.ws()
        if self.i >= len(self.s):
            raise ValueError(f"{self.where}: a flow collection ends early")
        c = self.s[self.i]
        if c == "[":
            return self.seq()
        if c == "{":
            return self.mapping()
        if c in "\"'":
            end = _quoted_end(self.s, self.i, self.where)
            tok = self.s[self.i : end]
            self.i = end
            return _quoted_body(tok[0], tok[1:-1], self.where)
        start = self.i
        while self.i < len(self.s):
            ch = self.s[self.i]
            if ch in ",[]{}" or (ch == ":" and (self.i + 1 >= len(self.s) or self.s[self.i + 1] in " ,[]{}\n")):
                break
            self.i += 1
        return _plain(_fold([p.strip(_WS) for p in self.s[start : self.i].strip(_WS).split("\n")]), self.where)

    def seq(self) -> list:
        self.i += 1
        out = []
        while True:
            self.ws()
            if self.s[self.i : self.i + 1] == "]":
                self.i += 1
                return out
            item = self.value()
            self.ws()
            if self.s[self.i : self.i + 1] == ":":
                raise ValueError(f"{self.where}: a 'key: value' pair inside [...] is outside the subset")
            out.append(item)
            self.sep("]")

    def mapping(self) -> dict:
        self.i += 1
        out: dict = {}
        while True:
            self.ws()
            if self.s[self.i : self.i + 1] == "}":
                self.i += 1
                return out
            key = self.value()
            self.ws()
            if self.s[self.i : self.i + 1] == ":":
                self.i += 1
                self.ws()
                val = None if self.s[self.i : self.i + 1] in (",", "}") else self.value()
            else:
                val = None
            _set(out, key, val, self.where)
            self.sep("}")

    def sep(self, close: str):
        self.ws()
        c = self.s[self.i : self.i + 1]
        if c == ",":
            self.i += 1
        elif c != close:
            raise ValueError(f"{self.where}: expected ',' or '{close}' in a flow collection, got {c or 'the end'!r}")


def _set(out: dict, key, val, where: str):
    if isinstance(key, (dict, list)):
        raise ValueError(f"{where}: a collection as a mapping key is outside the subset this reader takes")
    out[key] = val


# ------------------------------------------------------------------------------------------------------
# block structure
# ------------------------------------------------------------------------------------------------------
def _key_split(text: str) -> tuple[str, str] | None:
    """``key: rest`` -> (key, rest) where the colon is outside quotes and brackets, else None."""
    i, n = 0, len(text)
    if text[0] in "\"'":
        i = _quoted_end(text, 0, "")
        if text[i : i + 1] == ":" and (i + 1 == n or text[i + 1] == " "):
            return text[:i], text[i + 1 :].strip(_WS)
        return None
    if text[0] in "[{":
        return None
    while i < n:
        if text[i] == ":" and (i + 1 == n or text[i + 1] == " "):
            return text[:i].rstrip(_WS), text[i + 1 :].strip(_WS)
        i += 1
    return None


def _key(token: str, where: str):
    if token[:1] in "\"'":
        return _quoted(token, where)
    if token.startswith("? "):
        raise ValueError(f"{where}: a complex key ('? ') is outside the subset this reader takes")
    return _plain(token, where)


def _inline(lines: _Lines, text: str, parent_indent: int, where: str) -> Any:
    """A value written after ``key:`` or ``- `` (a flow collection, a quoted or a plain scalar), with any
    continuation lines (indented deeper than ``parent_indent``) folded in."""
    if text[0] in "[{":
        buf = text
        while True:
            try:
                f = _Flow(buf, where)
                v = f.value()
                f.ws()
                if f.i != len(buf):
                    raise ValueError(f"{where}: text after a flow collection: {buf[f.i:]!r}")
                return v
            except (ValueError, IndexError) as e:
                nxt = lines.peek()
                if nxt is None or nxt[0] <= parent_indent:
                    raise ValueError(str(e) if isinstance(e, ValueError) else f"{where}: bad flow collection") \
                        from None
                buf += "\n" + nxt[1]
                lines.i += 1
    if text[0] in "\"'":
        return _quoted_block(lines, text, where)
    parts, last = [text], lines.items[lines.i - 1][2] if lines.i else 0
    while True:
        nxt = lines.peek()
        if nxt is None or nxt[0] <= parent_indent:
            break
        if _key_split(nxt[1]) is not None:
            raise ValueError(f"line {nxt[2]}: a mapping inside a scalar value (a missing line break or indent?)")
        parts += [""] * (nxt[2] - last - 1) + [nxt[1]]  # blank lines between fold to line breaks
        last = nxt[2]
        lines.i += 1
    return _plain(_fold(parts), where)


def _quoted_block(lines: _Lines, text: str, where: str) -> str:
    """A quoted scalar starting with ``text`` (the current line's value), read from the raw lines until its
    closing quote (blank lines and ``#`` inside it are its content)."""
    no = lines.items[lines.i - 1][2]
    joined, end_no = text, no
    while True:
        try:
            end = _quoted_end(joined, 0, where)
            break
        except ValueError:
            if end_no >= len(lines.raw):
                raise
            joined += "\n" + lines.raw[end_no]
            end_no += 1
    rest = _strip_comment(joined[end:]).strip(_WS)
    if rest:
        raise ValueError(f"{where}: text after a quoted string: {rest!r}")
    while (nxt := lines.peek()) is not None and nxt[2] <= end_no:
        lines.i += 1
    return _quoted_body(text[0], joined[1 : end - 1], where)


def _quoted_body(quote: str, body: str, where: str) -> str:
    """The value of a quoted scalar whose text between the quotes is ``body`` (one line or several)."""
    if quote == '"':
        # an escaped line break joins without a space; other breaks fold as in a plain scalar
        return _double(_fold_quoted(re.sub(r"\\\n[ \t]*", "", body)), where)
    return _fold_quoted(body).replace("''", "'")


def _block(lines: _Lines, indent: int) -> Any:
    first = lines.peek()
    ind, text, no = first
    if text == "-" or text.startswith("- "):
        return _sequence(lines, ind)
    if _key_split(text) is None:
        lines.i += 1
        return _inline(lines, text, ind - 1, f"line {no}")
    return _mapping(lines, ind)


def _nested(lines: _Lines, indent: int, seq_ok: bool) -> Any:
    """The block value under a ``key:`` / ``-`` line at ``indent`` (None where nothing deeper follows)."""
    nxt = lines.peek()
    if nxt is None:
        return None
    if nxt[0] > indent or (seq_ok and nxt[0] == indent and (nxt[1] == "-" or nxt[1].startswith("- "))):
        return _block(lines, nxt[0])
    return None


def _mapping(lines: _Lines, indent: int) -> dict:
    out: dict = {}
    while (cur := lines.peek()) is not None and cur[0] == indent:
        ind, text, no = cur
        where = f"line {no}"
        if text == "-" or text.startswith("- "):
            raise ValueError(f"{where}: a sequence item where a mapping key was expected")
        split = _key_split(text)
        if split is None:
            raise ValueError(f"{where}: expected 'key: value', got {text!r}")
        key, rest = split
        lines.i += 1
        if rest and rest[0] in "&*!|>":
            raise ValueError(f"{where}: {rest[:1]!r} (anchor, alias, tag or block scalar) is outside the subset "
                             "this reader takes")
        _set(out, _key(key, where), _inline(lines, rest, indent, where) if rest else _nested(lines, indent, True),
             where)
    if (cur := lines.peek()) is not None and cur[0] > indent:
        raise ValueError(f"line {cur[2]}: indented deeper than the mapping it follows")
    return out


def _sequence(lines: _Lines, indent: int) -> list:
    out = []
    while (cur := lines.peek()) is not None and cur[0] == indent and (cur[1] == "-" or cur[1].startswith("- ")):
        ind, text, no = cur
        rest = text[1:].lstrip(" ")
        if not rest:
            lines.i += 1
            out.append(_nested(lines, indent, False))
            continue
        col = indent + (len(text) - len(rest))
        if rest == "-" or rest.startswith("- ") or _key_split(rest) is not None:
            lines.items[lines.i] = (col, rest, no)  # the item's content starts a block at its own column
            out.append(_block(lines, col))
        else:
            lines.i += 1
            out.append(_inline(lines, rest, indent, f"line {no}"))
    if (cur := lines.peek()) is not None and cur[0] > indent:
        raise ValueError(f"line {cur[2]}: indented deeper than the sequence it follows")
    return out


def loads(text: str) -> Any:
    """The YAML document ``text`` parsed as PyYAML's ``safe_load`` parses the subset this module documents
    (None for an empty document). Raises ValueError naming the line for anything outside that subset."""
    lines = _Lines(text)
    if lines.peek() is None:
        return None
    first = lines.peek()
    value = _block(lines, first[0])
    if (cur := lines.peek()) is not None:
        raise ValueError(f"line {cur[2]}: indented less than the document's first line, or a second top-level "
                         f"value: {cur[1]!r}")
    return value
