"""The one ``ast`` package reader (``edge_core/services/source_tree.py``): parses once, names what it cannot read."""

from __future__ import annotations

import pytest

from edge_core.services.source_tree import MAX_SOURCE_BYTES, SourceTree, Unreadable


@pytest.fixture
def package(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "a.py").write_text("X = 1\n")
    (root / "sub" / "__init__.py").write_text("Y = 2\n")
    (root / "broken.py").write_text("def (:\n")
    (root / "latin.py").write_bytes(b"# \xff\n")
    return root


def test_a_file_is_parsed_once_and_its_stat_recorded(package):
    tree = SourceTree(package, package="pkg", label="pkg")
    first = tree.module("a.py")
    assert tree.module("a.py") is first
    assert [(rel, size) for rel, size, _ in tree.files] == [("a.py", 6)]


def test_dotted_names_resolve_within_the_named_package(package):
    tree = SourceTree(package, package="pkg", label="pkg")
    assert (tree.module_file("pkg.a"), tree.module_file("pkg.sub")) == ("a.py", "sub/__init__.py")
    with pytest.raises(Unreadable, match="not a module of the pkg package"):
        tree.module_file("other.a")


@pytest.mark.parametrize(("rel", "why"), [("missing.py", "cannot be read"), ("broken.py", "does not parse"),
                                          ("latin.py", "is not UTF-8")])
def test_what_cannot_be_read_is_named_with_its_file(package, rel, why):
    with pytest.raises(Unreadable, match=f"^{rel}: {why}"):
        SourceTree(package).module(rel)


def test_a_file_too_large_to_be_source_is_refused(package):
    (package / "big.py").write_bytes(b"#" * (MAX_SOURCE_BYTES + 1))
    with pytest.raises(Unreadable, match="is not a transformers source file"):
        SourceTree(package, package="transformers", label="transformers").module("big.py")
