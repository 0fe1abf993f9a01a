#!/usr/bin/python3
# test_check_layout.py: self-tests of check_layout.py on synthetic C++ snippets and trees, so that the
# layout rule gradsync enforces (functions <= 60 lines, files <= 450, a small public API) is measured the
# way it is stated: a 61-line function is caught and a 60-line one is not, a long namespace or class is
# not a function, inline member functions are measured one by one, and braces in comments, strings, raw
# strings and initializers do not confuse it. Run: python3 scripts/test_check_layout.py (stdlib only).
import contextlib
import io
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_layout as cl  # noqa: E402


def body(n, indent="  "):
    """n statement lines."""
    return "".join("%sx += %d;\n" % (indent, k) for k in range(n))


def function(name, lines, indent=""):
    """A function of exactly `lines` lines: signature line, lines-2 statements, closing brace."""
    assert lines >= 3
    return "%sint %s(int x) {\n%s%sreturn x;\n%s}\n" % (indent, name, body(lines - 3, indent + "  "),
                                                       indent + "  ", indent)


def measured(text):
    return [(f.name, f.start_line, f.lines) for f in cl.find_functions(text)]


class FunctionLength(unittest.TestCase):
    def test_61_lines_is_caught_and_60_is_not(self):
        with tempfile.TemporaryDirectory() as root:
            os.makedirs(os.path.join(root, "src"))
            with open(os.path.join(root, "src", "a.cpp"), "w") as f:
                f.write(function("sixty", 60) + "\n" + function("sixty_one", 61))
            violations, _ = cl.check(root)
        self.assertEqual(len(violations), 1, violations)
        self.assertIn("src/a.cpp:62: function sixty_one is 61 lines (limit 60)", violations[0])

    def test_counts_from_the_signature_to_the_closing_brace(self):
        self.assertEqual(measured(function("f", 3)), [("f", 1, 3)])
        self.assertEqual(measured("\n\n" + function("f", 10)), [("f", 3, 10)])
        self.assertEqual(measured("void f() {}\n"), [("f", 1, 1)])

    def test_a_500_line_namespace_is_not_a_function(self):
        text = "namespace gradsync {\nnamespace {\n" + "".join(function("f%d" % k, 10) for k in range(50))
        text += "}  // namespace\n}  // namespace gradsync\n"
        self.assertGreater(text.count("\n"), 500)
        fns = measured(text)
        self.assertEqual(len(fns), 50)
        self.assertTrue(all(lines == 10 for _, _, lines in fns))
        self.assertEqual(measured("namespace a::b {\n" + body(498) + "}\n"), [])

    def test_class_with_inline_methods_is_measured_per_method(self):
        text = "class Big {\n public:\n" + function("small", 30, "  ") + function("large", 61, "  ")
        text += " private:\n  int x_ = 0;\n  struct Inner {\n" + function("inner", 5, "    ") + "  };\n};\n"
        self.assertEqual(measured(text), [("small", 3, 30), ("large", 33, 61), ("inner", 97, 5)])

    def test_struct_enum_union_and_extern_c_are_scopes(self):
        text = ("extern \"C\" {\n" + function("c_api", 4) + "}\n"
                "template <typename T>\nstruct Box : Base<decltype(T())> {\n" + function("get", 3, "  ") + "};\n"
                "enum class Color : int {\n  Red,\n  Green,\n};\n"
                "union U {\n  int i;\n  float f;\n};\n")
        self.assertEqual(measured(text), [("c_api", 2, 4), ("get", 9, 3)])

    def test_template_function_starts_at_its_name(self):
        text = "template <typename T,\n          typename U = int>\nstd::vector<T>\nmake(T a,\n     U b) {\n  return {};\n}\n"
        self.assertEqual(measured(text), [("make", 4, 4)])

    def test_constructor_with_multiline_initializer_list(self):
        text = ("Foo::Foo(int a,\n"
                "         int b)\n"
                "    : a_(a),\n"
                "      b_{b},\n"
                "      v_{{1, 2}, {3, 4}},\n"
                "      Base<int>{a} {\n"
                "  run();\n"
                "}\n"
                "struct S {\n"
                "  S() : x_{1} {}\n"
                "  int x_;\n"
                "};\n")
        self.assertEqual(measured(text), [("Foo::Foo", 1, 8), ("S", 10, 1)])

    def test_initializers_are_not_functions(self):
        text = ("const std::map<std::string, int> kTable = {\n" + "".join('    {"k%d", %d},\n' % (k, k) for k in range(80))
                + "};\n"
                "static const int kGrid[2][2] = {{1, 2}, {3, 4}};\n"
                "std::vector<int> kList{1, 2, 3};\n"
                "struct Options {\n  std::function<void()> callback{};\n  std::vector<int> sizes = {1, 2};\n  int n{3};\n};\n"
                + function("after", 3))
        self.assertEqual(measured(text), [("after", 90, 3)])

    def test_lambdas_and_local_classes_count_toward_their_function(self):
        text = ("void outer() {\n"
                "  auto f = [&](int x) {\n    return x;\n  };\n"
                "  struct Local {\n    int g() { return 1; }\n  };\n"
                "  std::vector<int> v{1, 2};\n"
                "}\n")
        self.assertEqual(measured(text), [("outer", 1, 9)])

    def test_namespace_scope_lambda_is_measured(self):
        text = "namespace {\nauto kRun = [](int x) -> int {\n" + body(60) + "  return x;\n};\n}\n"
        self.assertEqual(measured(text), [("kRun", 2, 63)])

    def test_braces_in_comments_strings_and_literals_are_ignored(self):
        text = ('// void commented() {\n'
                '/* {{{ block\n   comment } */\n'
                'const char* f() {\n'
                '  const char* s = "{ \\" {";\n'
                "  char open = '{';\n"
                "  char quote = '\\'';\n"
                '  auto raw = R"(a } ) " b)";\n'
                '  auto raw2 = R"xy(})" )xy";\n'
                '  auto wide = u8R"(})";\n'
                "  int big = 1'000'000;\n"
                "  return s; }\n"
                "#define OPEN {\n"
                "#define MULTI { \\\n  }\n"
                "void g() {}\n")
        self.assertEqual(measured(text), [("f", 4, 9), ("g", 16, 1)])

    def test_operators_and_qualified_names(self):
        text = ("struct V {\n"
                "  bool operator()(int a) const {\n    return a > 0;\n  }\n"
                "  V& operator=(const V& o) {\n    return *this;\n  }\n"
                "  bool operator<(const V& o) const { return false; }\n"
                "  ~V() { }\n"
                "};\n"
                "V operator+(V a, V b) {\n  return a;\n}\n"
                "auto ns::Thing::run() const noexcept -> std::pair<int, int> {\n  return {1, 2};\n}\n")
        self.assertEqual(measured(text), [("operator()", 2, 3), ("operator=", 5, 3), ("operator<", 8, 1),
                                          ("~V", 9, 1), ("operator+", 11, 3), ("ns::Thing::run", 14, 3)])

    def test_default_argument_lambda_and_macro_before_function(self):
        text = ("TORCH_MODULE(Net)\n"
                "void f(std::function<void()> cb = [] {}) {\n  cb();\n}\n")
        self.assertEqual(measured(text), [("f", 2, 3)])

    def test_function_try_block_includes_its_handlers(self):
        text = ("void f() try {\n  a();\n} catch (const std::exception& e) {\n  b();\n} catch (...) {\n}\n"
                "void g() {}\n")
        self.assertEqual(measured(text), [("f", 1, 6), ("g", 7, 1)])

    def test_unbalanced_braces_are_reported(self):
        with self.assertRaises(cl.ParseError):
            cl.find_functions("void f() {\n")
        with self.assertRaises(cl.ParseError):
            cl.find_functions("}\n")


class TreeRules(unittest.TestCase):
    def make_tree(self, root, files):
        for rel, text in files.items():
            path = os.path.join(root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)

    def test_file_length_limit(self):
        with tempfile.TemporaryDirectory() as root:
            self.make_tree(root, {"src/ok.cpp": "\n" * 450, "tools/x/big.h": "int x;\n" * 451})
            violations, _ = cl.check(root)
        self.assertEqual(violations, ["tools/x/big.h:1: file is 451 lines (limit 450)"])

    def test_public_headers_count_and_state(self):
        files = {"include/gradsync/h%02d.h" % k: "#pragma once\n" for k in range(19)}
        with tempfile.TemporaryDirectory() as root:
            self.make_tree(root, files)
            self.assertEqual(cl.check(root)[0], [])
            self.make_tree(root, {"include/gradsync/extra.h": "class Api {\n  struct State;\n};\n// struct State\n"})
            violations, _ = cl.check(root)
        self.assertEqual(len(violations), 2, violations)
        self.assertIn("include/gradsync/: 20 public headers (limit 19)", violations[0])
        self.assertIn("include/gradsync/extra.h:2: public header declares a type named State", violations[1])

    def test_tools_holds_main_and_folders_only(self):
        with tempfile.TemporaryDirectory() as root:
            self.make_tree(root, {"tools/main.cpp": "int main() { return 0; }\n", "tools/train/train.cpp": "",
                                  "tools/helper.cpp": ""})
            violations, _ = cl.check(root)
        self.assertEqual(len(violations), 1, violations)
        self.assertIn("tools/helper.cpp", violations[0])

    def test_main_exit_status_and_summary(self):
        with tempfile.TemporaryDirectory() as root:
            self.make_tree(root, {"src/a.cpp": function("f", 12), "tools/main.cpp": function("main", 5)})
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                self.assertEqual(cl.main(["check_layout.py", root]), 0)
            self.assertEqual(out.getvalue().strip(),
                             "check_layout: ok (2 files, longest function 12 lines at src/a.cpp:1 f, "
                             "largest file 12 lines at src/a.cpp)")
            self.make_tree(root, {"src/b.cpp": function("g", 61)})
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                self.assertEqual(cl.main(["check_layout.py", root]), 1)
            self.assertIn("check_layout: 1 violations", out.getvalue())


if __name__ == "__main__":
    unittest.main(verbosity=1)
