#!/usr/bin/python3
# check_doc_paths.py ROOT: every repository path that gradsync's docs name must exist.
#
# What it checks, and why. gradsync's docs (README.md and docs/*.md) point readers at files: "the reducer
# scales in `src/ddp/reducer.cpp`", "see [sharding](docs/sharding.md)". When code moves, such a pointer
# silently goes stale and the doc stops being true. This script reads
#   - every inline code span (`...`) outside fenced code blocks, split into words; a word counts as a
#     repository path when it contains `/` and starts with one of the repository's top-level entries
#     (src/ include/ tools/ tests/ bench/ examples/ scripts/ docs/ .ci/ ...), or when it is relative to
#     include/ (`gradsync/engine.h` means include/gradsync/engine.h). `build/...` (generated) is skipped,
#     so are words with placeholders (`<name>`, `{r}`, `...`); a word with `*` or `?` is a glob that must
#     match at least one path. Quotes and <> around a word, trailing punctuation and a `:LINE` suffix are
#     stripped; a trailing `/` asks for a directory;
#   - every markdown link or image `[x](target)` and reference definition `[x]: target` whose target is
#     a relative file link (no scheme, not only an `#anchor`), resolved against the doc's folder (or the
#     repository root for a target starting with `/`).
# Prints each missing path with its doc and line and a one-line summary; exits 1 if any is missing,
# 2 on a usage error. Python 3 standard library only.
import glob
import os
import re
import sys
import urllib.parse

TOP_LEVEL = ("src", "include", "tools", "tests", "bench", "examples", "scripts", "docs", "cmake", "build", ".ci")
TOP_LEVEL_FILES = ("CMakeLists.txt", "Makefile", "README.md")
GENERATED = ("build",)
INCLUDE_RELATIVE = ("gradsync",)   # `gradsync/x.h` is include/gradsync/x.h, as code includes it

FENCE_RE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
CODE_SPAN_RE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
LINK_RE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^\s)]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REF_DEF_RE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
LINE_SUFFIX_RE = re.compile(r"(:\d+(?:[-:]\d+)?)+$")
PLACEHOLDER_RE = re.compile(r"[<>{}]|\.\.\.|\$")
TRAILING = ".,;:!)]'\"`"
LEADING = "(['\"`"


def docs_of(root):
    docs = []
    if os.path.isfile(os.path.join(root, "README.md")):
        docs.append("README.md")
    docs_dir = os.path.join(root, "docs")
    if os.path.isdir(docs_dir):
        docs += ["docs/" + f for f in sorted(os.listdir(docs_dir)) if f.endswith(".md")]
    return docs


def clean_word(word):
    """A code-span word as a candidate path: quotes, brackets, punctuation and `:LINE` stripped."""
    w = word.strip()
    if len(w) > 2 and w[0] == "<" and w[-1] == ">" and "<" not in w[1:-1]:
        w = w[1:-1]            # #include <gradsync/ddp.h>
    if PLACEHOLDER_RE.search(w):
        return None            # src/<name>.cpp, tests/...: not one path
    w = w.lstrip(LEADING)
    prev = None
    while prev != w:
        prev = w
        w = w.rstrip(TRAILING)
        w = LINE_SUFFIX_RE.sub("", w)
    if w.startswith("./"):
        w = w[2:]
    return w


def repo_path(word):
    """The repository path (relative to ROOT) that a code-span word names, or None if it names none."""
    w = clean_word(word)
    if not w:
        return None
    first = w.split("/", 1)[0]
    if first in GENERATED:
        return None
    if "/" in w and first in TOP_LEVEL:
        return w
    if "/" in w and first in INCLUDE_RELATIVE:
        return "include/" + w
    if w in TOP_LEVEL_FILES:
        return w
    return None


def exists(root, rel):
    if "*" in rel or "?" in rel or "[" in rel:
        return bool(glob.glob(os.path.join(root, rel.rstrip("/"))))
    full = os.path.join(root, rel)
    if rel.endswith("/"):
        return os.path.isdir(full)
    return os.path.exists(full)


def link_path(doc, target):
    """The repository path a markdown link target names, or None for external links and bare anchors."""
    t = target.strip()
    if t.startswith("<") and t.endswith(">"):
        t = t[1:-1].strip()
    if not t or t.startswith("#") or t.startswith("//") or SCHEME_RE.match(t):
        return None
    t = urllib.parse.unquote(t.split("#", 1)[0].split("?", 1)[0])
    if not t:
        return None
    if t.startswith("/"):
        rel = t.lstrip("/")
    else:
        rel = os.path.normpath(os.path.join(os.path.dirname(doc), t))
        if t.endswith("/"):
            rel += "/"
    return rel


BLOCK_START_RE = re.compile(r"^\s*(#|\||>|[-*+]\s|\d+[.)]\s)")


def blocks(lines):
    """The doc's text outside fenced code blocks, as blocks [(first line number, [lines])]: a paragraph
    (code spans may run across its line breaks), or one heading, table row, quote line or list item's
    first line (a new one of those ends the block before it)."""
    out, current, in_fence = [], None, None
    for number, line in enumerate(lines, 1):
        m = FENCE_RE.match(line)
        if m:
            marker = m.group(1)
            if in_fence is None:
                in_fence = marker
            elif marker[0] == in_fence[0] and len(marker) >= len(in_fence):
                in_fence = None
            current = None
            continue
        if in_fence is not None:
            continue
        if not line.strip():
            current = None
            continue
        if current is None or BLOCK_START_RE.match(line) or current[1][-1].lstrip().startswith(("#", "|")):
            current = (number, [])
            out.append(current)
        current[1].append(line)
    return out


def check_doc(root, doc):
    """Returns (missing, checked): missing is a list of `doc:line: ...` strings."""
    checked = 0
    with open(os.path.join(root, doc), encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    found = []  # (line, message)
    for first, block in blocks(lines):
        text = "\n".join(block)
        seen = set()

        def report(offset, what):
            found.append((first + text.count("\n", 0, offset), what))

        for span in CODE_SPAN_RE.finditer(text):
            for word in re.finditer(r"[^\s=,]+", span.group(2)):
                rel = repo_path(word.group(0))
                if rel is None or rel in seen:
                    continue
                seen.add(rel)
                checked += 1
                if not exists(root, rel):
                    report(span.start(2) + word.start(), "`%s` names %s, which does not exist" % (word.group(0), rel))
        plain = CODE_SPAN_RE.sub(lambda s: re.sub(r"[^\n]", " ", s.group(0)), text)
        targets = [(m.start(), m.group(1)) for m in LINK_RE.finditer(plain)]
        offset = 0
        for line in plain.split("\n"):
            ref = REF_DEF_RE.match(line)
            if ref:
                targets.append((offset, ref.group(1)))
            offset += len(line) + 1
        for at, target in targets:
            rel = link_path(doc, target)
            if rel is None or rel in seen:
                continue
            seen.add(rel)
            checked += 1
            if rel.split("/", 1)[0] == ".." or not exists(root, rel):
                report(at, "link (%s) points to %s, which does not exist" % (target, rel))
    missing = ["%s:%d: %s" % (doc, line, what) for line, what in sorted(found, key=lambda f: f[0])]
    return missing, checked


def main(argv):
    if len(argv) != 2 or not os.path.isdir(argv[1]):
        sys.stderr.write("usage: check_doc_paths.py ROOT   (ROOT: the gradsync source tree)\n")
        return 2
    root = argv[1]
    docs = docs_of(root)
    missing, checked = [], 0
    for doc in docs:
        m, c = check_doc(root, doc)
        missing += m
        checked += c
    for line in missing:
        print(line)
    if missing:
        print("check_doc_paths: %d missing paths (%d paths checked in %d docs)" % (len(missing), checked, len(docs)))
        return 1
    print("check_doc_paths: ok (%d paths checked in %d docs)" % (checked, len(docs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
