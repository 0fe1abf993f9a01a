#!/usr/bin/python3
# check_layout.py ROOT: gradsync's layout rules, checked on the C++ sources under src/, include/ and tools/.
#
# What it checks, and why. gradsync keeps functions and files small so that each one can be read in one
# sitting, and its public API small so that users learn it in an afternoon:
#   - no function is over 60 lines (a .h/.cpp under src/, include/, tools/), counted from the line of its
#     name (the line holding the name before its parameter list `(`) to its closing brace, inclusive;
#     lambdas and local classes count toward the function they are written in;
#   - no such file is over 450 lines;
#   - include/gradsync/ (the public API) holds at most 19 headers, and none of them declares a type named
#     `State` (a "State" there is an implementation detail leaking into the API: keep it in src/);
#   - tools/ holds only main.cpp and folders (every tool lives in its own tools/<name>/).
# Prints every violation as `path:line: what is N (limit L)` and a one-line summary; exits 1 on any
# violation, 2 on a usage error. Python 3 standard library only.
#
# How functions are found: comments, string/char literals (raw strings too) and preprocessor lines are
# blanked, then a brace-stack walk decides for each `{` met at namespace or class scope what it opens,
# from the text since the previous `;`, `{` or `}` at that scope (its "head"): `namespace`/`extern "C"`
# (a scope), `class`/`struct`/`union`/`enum` (a class scope, whose inline member functions are measured
# one by one), an initializer (`= {...}`, `T x{...}`, `{{...}}`: not a function), a brace inside a
# constructor's initializer list (`: a_{x}`: part of the head), or else, when the head has a parameter
# list `(...)`, a function body. Everything inside a function body belongs to that function.
import bisect
import os
import re
import sys

MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 450
MAX_PUBLIC_HEADERS = 19
SOURCE_DIRS = ("src", "include", "tools")
CPP_EXTENSIONS = (".h", ".hpp", ".hh", ".cpp", ".cc", ".cxx")
HEADER_EXTENSIONS = (".h", ".hpp", ".hh")
PUBLIC_DIR = os.path.join("include", "gradsync")

RAW_PREFIXES = ("R", "u8R", "uR", "UR", "LR")
# Identifiers that may stand right before a `(` in a function's head without being its name.
NOT_A_NAME = {"decltype", "noexcept", "alignas", "alignof", "sizeof", "throw", "__attribute__", "__declspec",
              "requires", "static_assert", "return"}
CONTROL = {"if", "else", "for", "while", "do", "switch", "case", "catch", "try", "return"}
OPERATOR_RE = re.compile(r"\boperator\s*(\(\s*\)|\[\s*\]|->\*?|<=>|<<=|>>=|<<|>>|[-+*/%^&|~!=<>,]=?|&&|\|\||"
                         r"\+\+|--|new\s*\[\s*\]|delete\s*\[\s*\]|new\b|delete\b|\"\"\s*\w+)")
ACCESS_RE = re.compile(r"\s*\b(public|private|protected)\s*:(?!:)")
IDENT_BEFORE_RE = re.compile(r"((?:~\s*)?[A-Za-z_]\w*)\s*$")


class Function:
    def __init__(self, name, start_line, end_line=None):
        self.name, self.start_line, self.end_line = name, start_line, end_line

    @property
    def lines(self):
        return self.end_line - self.start_line + 1


# ---- lexing ------------------------------------------------------------------------------------------

def blank_code(text):
    """Returns text with comments, string and char literals' contents and preprocessor lines replaced by
    spaces (newlines kept, so offsets and line numbers are those of the original)."""
    out = list(text)
    n = len(text)

    def blank(a, b):
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    i = 0
    line_start = True      # only whitespace (or comments) so far on this line
    directive = False      # inside a preprocessor line (until an unescaped newline)
    while i < n:
        c = text[i]
        if c == "\n":
            if directive and not text[max(0, i - 2):i].rstrip("\r").endswith("\\"):
                directive = False
            line_start = True
            i += 1
            continue
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank(i, j)
            i = j
            continue
        if directive:
            blank(i, i + 1)
            i += 1
            continue
        if c in " \t\r\f\v":
            i += 1
            continue
        if c == "#" and line_start:
            directive = True
            blank(i, i + 1)
            i += 1
            continue
        line_start = False
        if c == '"':
            k = i
            while k > 0 and (text[k - 1].isalnum() or text[k - 1] == "_"):
                k -= 1
            if text[k:i] in RAW_PREFIXES:
                open_paren = text.find("(", i + 1)
                delim = text[i + 1:open_paren] if open_paren >= 0 else ""
                end = text.find(")" + delim + '"', max(open_paren, i + 1))
                end = n if (open_paren < 0 or end < 0) else end + len(delim) + 2
                blank(i + 1, end - 1)
                i = end
                continue
            j = i + 1
            while j < n and text[j] != '"' and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            blank(i + 1, j)
            i = j + 1
            continue
        if c == "'":
            k = i
            while k > 0 and (text[k - 1].isalnum() or text[k - 1] in "_."):
                k -= 1
            if k < i and text[k].isdigit():   # a digit separator: 1'000'000, 0xFF'FF
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != "'" and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            blank(i + 1, j)
            i = j + 1
            continue
        i += 1
    return "".join(out)


def normalize_operators(code):
    """`operator()`, `operator<<`, `operator=` ... become `operator__..` of the same length, so that their
    symbols are not taken for a parameter list, a template bracket or an initializer."""
    return OPERATOR_RE.sub(lambda m: "operator" + "_" * (len(m.group(0)) - len("operator")), code)


# ---- reading one head --------------------------------------------------------------------------------

def skip_prefixes(head, pos):
    """Skips access specifiers, `template <...>` clauses and `[[attributes]]` at the start of a head."""
    while True:
        m = ACCESS_RE.match(head, pos)
        if m:
            pos = m.end()
            continue
        m = re.compile(r"\s*\btemplate\s*<").match(head, pos)
        if m:
            depth, k = 1, m.end()
            while k < len(head) and depth:
                depth += {"<": 1, ">": -1}.get(head[k], 0)
                k += 1
            pos = k
            continue
        m = re.compile(r"\s*\[\[").match(head, pos)
        if m:
            k = head.find("]]", m.end())
            pos = len(head) if k < 0 else k + 2
            continue
        return pos


def scan_head(head, start):
    """Walks a head at paren/bracket/angle depth 0 from `start`. Returns a dict: `paren_open` (its parens
    are unbalanced: the `{` is inside an expression), `assign` (offset of a top-level `=` initializer or
    None), `name_paren` (offset of the `(` of the parameter list or None), `init_colon` (offset of a
    constructor's initializer-list `:` or None), `class_kw` (a class-key with no parameter list after it)."""
    paren = bracket = angle = 0
    seen_close = False
    assign = name_paren = init_colon = None
    class_kw_at = None
    candidates = []
    k = start
    n = len(head)
    while k < n:
        c = head[k]
        if c == "(":
            if paren == 0 and bracket == 0 and angle == 0 and init_colon is None:
                m = IDENT_BEFORE_RE.search(head, start, k)
                if m and m.group(1).lstrip("~ ") not in NOT_A_NAME:
                    candidates.append(k)
            paren += 1
        elif c == ")":
            paren -= 1
            if paren == 0:
                seen_close = True
        elif c == "[":
            bracket += 1
        elif c == "]":
            bracket -= 1
        elif paren == 0 and bracket == 0:
            if c == "<":
                angle += 1
            elif c == ">":
                if head[k - 1:k] == "-":   # trailing return type `->`: stop looking for the name
                    if init_colon is None and name_paren is None and candidates:
                        name_paren = candidates[-1]
                else:
                    angle = max(0, angle - 1)
            elif angle == 0:
                if c == "=" and head[k + 1:k + 2] != "=" and head[k - 1:k] not in ("=", "!", "<", ">"):
                    if assign is None and name_paren is None and init_colon is None:
                        assign = k
                elif c == ":" and head[k + 1:k + 2] != ":" and head[k - 1:k] != ":" and seen_close:
                    if init_colon is None:
                        init_colon = k
                elif c.isalpha() and (k == 0 or not (head[k - 1].isalnum() or head[k - 1] == "_")):
                    m = re.compile(r"(class|struct|union|enum)\b").match(head, k)
                    if m:
                        class_kw_at = k
                        candidates = []   # a parameter list must come after the class-key
        k += 1
    if name_paren is None and candidates:
        name_paren = candidates[-1]
    return {"paren_open": paren > 0, "assign": assign, "name_paren": name_paren, "init_colon": init_colon,
            "class_kw": class_kw_at is not None and (name_paren is None or name_paren < class_kw_at)}


QUALIFIED_NAME_RE = re.compile(r"((?:[A-Za-z_]\w*\s*(?:<[^(){};]*>)?\s*::\s*)*(?:~\s*)?[A-Za-z_]\w*)\s*$")
LAMBDA_RHS_RE = re.compile(r"\s*\[[^\]]*\]\s*(\([^;{}]*\))?[\s\w:<>,&*\->]*$")


def classify(head):
    """What a `{` at namespace or class scope opens, given its head. Returns (kind, name_offset, name_span):
    kind is 'scope', 'class', 'function', 'lambda', 'init', 'ctor_brace' (inside a constructor's
    initializer list), 'expression' (a brace inside an unfinished expression, as a lambda in a default
    argument), 'catch' (a handler of a function-try-block) or 'opaque' (a stray control block);
    for a function, name_offset is where its (unqualified) name starts and name_span its qualified name's."""
    start = skip_prefixes(head, 0)
    words = re.findall(r"[A-Za-z_]\w*", head[start:])
    first = words[0] if words else ""
    if re.search(r"\bnamespace\b", head[start:]):
        return "scope", None, None
    if first == "extern" and "(" not in head[start:]:
        return "scope", None, None
    info = scan_head(head, start)
    if info["paren_open"]:
        return "expression", None, None
    if first == "catch" and not head[:start].strip():
        return "catch", None, None
    if first in CONTROL:
        return "opaque", None, None
    if first in ("class", "struct", "union", "enum", "typedef") or info["class_kw"]:
        return "class", None, None
    if info["assign"] is not None:
        rhs = head[info["assign"] + 1:]
        if LAMBDA_RHS_RE.match(rhs):
            m = IDENT_BEFORE_RE.search(head, start, info["assign"])
            if m:
                return "lambda", m.start(1), (m.start(1), m.end(1))
        return "init", None, None
    if info["name_paren"] is None:
        return "init", None, None
    if info["init_colon"] is not None:
        before = head.rstrip()
        if before and (before[-1].isalnum() or before[-1] in "_>"):
            return "ctor_brace", None, None
    p = info["name_paren"]
    m = QUALIFIED_NAME_RE.search(head, start, p)
    if not m:
        return "function", p, (p, p)
    last = IDENT_BEFORE_RE.search(head, start, p)
    return "function", last.start(1), (m.start(1), m.end(1))


# ---- one file ----------------------------------------------------------------------------------------

class ParseError(Exception):
    pass


def find_functions(text):
    """Every function body at namespace or class scope in a C++ source, in order, as Function objects."""
    raw = blank_code(text)
    code = normalize_operators(raw)
    newlines = [k for k, c in enumerate(code) if c == "\n"]

    def line(offset):  # 1-based line of an offset
        return bisect.bisect_left(newlines, offset) + 1

    scope_kinds = ("top", "scope", "class")
    # A frame: [kind, head_start (for scopes), Function or None, keep_head]
    stack = [["top", 0, None, False]]
    functions = []
    for i, c in enumerate(code):
        if c == ";":
            if stack[-1][0] in scope_kinds:
                stack[-1][1] = i + 1
        elif c == "{":
            top = stack[-1]
            if top[0] not in scope_kinds:
                stack.append(["inner", 0, None, False])
                continue
            head = code[top[1]:i]
            kind, name_at, span = classify(head)
            if kind in ("function", "lambda"):
                name = re.sub(r"\s+", "", raw[top[1] + span[0]:top[1] + span[1]]) or "?"
                fn = Function(name, line(top[1] + name_at))
                functions.append(fn)
                stack.append(["function", 0, fn, False])
            elif kind in ("scope", "class"):
                stack.append([kind, i + 1, None, False])
            elif kind == "catch" and functions and functions[-1].end_line == line(top[1]):
                stack.append(["function", 0, functions[-1], False])   # `void f() try {...} catch (...) {...}`
            else:  # init, ctor_brace, expression, opaque: not a function, not a scope
                stack.append(["inner", 0, None, kind in ("ctor_brace", "expression")])
        elif c == "}":
            if len(stack) == 1:
                raise ParseError("unbalanced '}' at line %d" % line(i))
            kind, _, fn, keep_head = stack.pop()
            if fn is not None:
                fn.end_line = line(i)
            parent = stack[-1]
            if parent[0] in scope_kinds and not keep_head:
                parent[1] = i + 1
    if len(stack) != 1:
        raise ParseError("unclosed '{' (%d still open at the end of the file)" % (len(stack) - 1))
    return functions


def count_lines(text):
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


# ---- the tree ----------------------------------------------------------------------------------------

def source_files(root):
    for top in SOURCE_DIRS:
        base = os.path.join(root, top)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for f in sorted(filenames):
                if f.endswith(CPP_EXTENSIONS):
                    yield os.path.relpath(os.path.join(dirpath, f), root)


def check(root, max_function=MAX_FUNCTION_LINES, max_file=MAX_FILE_LINES, max_headers=MAX_PUBLIC_HEADERS):
    """Returns (violations, stats): violations are strings, stats a dict for the summary."""
    violations = []
    longest = None   # (lines, path, Function)
    largest = None   # (lines, path)
    files = list(source_files(root))
    for rel in files:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        n = count_lines(text)
        if largest is None or n > largest[0]:
            largest = (n, rel)
        if n > max_file:
            violations.append("%s:1: file is %d lines (limit %d)" % (rel, n, max_file))
        try:
            functions = find_functions(text)
        except ParseError as e:
            violations.append("%s:1: cannot measure its functions: %s" % (rel, e))
            continue
        for fn in functions:
            if longest is None or fn.lines > longest[0]:
                longest = (fn.lines, rel, fn)
            if fn.lines > max_function:
                violations.append("%s:%d: function %s is %d lines (limit %d)"
                                  % (rel, fn.start_line, fn.name, fn.lines, max_function))

    public = os.path.join(root, PUBLIC_DIR)
    headers = []
    for dirpath, dirnames, filenames in os.walk(public):
        dirnames[:] = sorted(dirnames)
        headers += [os.path.relpath(os.path.join(dirpath, f), root) for f in sorted(filenames)
                    if f.endswith(HEADER_EXTENSIONS)]
    if len(headers) > max_headers:
        violations.append("%s/: %d public headers (limit %d): %s"
                          % (PUBLIC_DIR, len(headers), max_headers, ", ".join(sorted(headers))))
    state_re = re.compile(r"\b(?:(?:class|struct|union|enum(?:\s+class|\s+struct)?)\s+(?:\w+\s*::\s*)*State\b"
                          r"|using\s+State\s*=|typedef\b[^;]*\bState\s*;)")
    for rel in headers:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        code = blank_code(text)
        for m in state_re.finditer(code):
            ln = code.count("\n", 0, m.start()) + 1
            what = re.sub(r"\s+", " ", m.group(0))
            violations.append("%s:%d: public header declares a type named State (`%s`) (limit: none)"
                              % (rel, ln, what))

    tools = os.path.join(root, "tools")
    if os.path.isdir(tools):
        for entry in sorted(os.listdir(tools)):
            if entry != "main.cpp" and not os.path.isdir(os.path.join(tools, entry)):
                violations.append("tools/%s: a file at the top of tools/ (limit: only main.cpp and folders)"
                                  % entry)

    stats = {"files": len(files), "longest": longest, "largest": largest}
    return violations, stats


def summary(violations, stats):
    parts = ["%d files" % stats["files"]]
    if stats["longest"]:
        lines, rel, fn = stats["longest"]
        parts.append("longest function %d lines at %s:%d %s" % (lines, rel, fn.start_line, fn.name))
    if stats["largest"]:
        parts.append("largest file %d lines at %s" % stats["largest"])
    if violations:
        return "check_layout: %d violations (%s)" % (len(violations), ", ".join(parts))
    return "check_layout: ok (%s)" % ", ".join(parts)


def main(argv):
    args = argv[1:]
    top = None
    if len(args) >= 2 and args[0] == "--top":
        top = int(args[1])
        args = args[2:]
    if len(args) != 1 or not os.path.isdir(args[0]):
        sys.stderr.write("usage: check_layout.py [--top N] ROOT   (ROOT: the gradsync source tree)\n")
        return 2
    root = args[0]
    if top is not None:   # a listing of the N longest functions, for whoever is splitting them
        rows = []
        for rel in source_files(root):
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                try:
                    rows += [(fn.lines, rel, fn) for fn in find_functions(f.read())]
                except ParseError:
                    pass
        for lines, rel, fn in sorted(rows, key=lambda r: -r[0])[:top]:
            print("%4d  %s:%d %s" % (lines, rel, fn.start_line, fn.name))
    violations, stats = check(root)
    for v in violations:
        print(v)
    print(summary(violations, stats))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
