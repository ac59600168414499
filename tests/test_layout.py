"""The package keeps the shape of its pipeline: small modules, short functions, no
private names across modules, no import cycle, private torch APIs in one place."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "divtrace"
MODULES = sorted(PACKAGE.rglob("*.py"))
STAGES = ("plan", "record", "align", "measure", "explain", "report")


def name_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring does not count
    return 0 if not body else body[-1].end_lineno - body[0].lineno + 1  # type: ignore[operator]


def runtime_imports(tree: ast.Module) -> list[ast.ImportFrom | ast.Import]:
    """Every import that runs (module level or in a function), not those for typing."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    return [n for n in ast.walk(tree)
            if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in skipped]


def test_the_stages_are_subpackages() -> None:
    for stage in STAGES:
        assert (PACKAGE / stage / "__init__.py").is_file(), stage


@pytest.mark.parametrize("path", MODULES, ids=name_of)
def test_modules_are_small_and_functions_short(path: Path) -> None:
    source = path.read_text()
    assert len(source.splitlines()) <= 350
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert body_lines(node) <= 60, f"{node.name} is {body_lines(node)} lines long"


def test_compare_is_a_thin_face() -> None:
    tree = ast.parse((PACKAGE / "compare.py").read_text())
    face = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "compare")
    assert body_lines(face) <= 60
    assert len(face.args.kwonlyargs) <= 14  # a small face: everything else in explain=, Run,
    # Resources, kind= (chunk= is run a's batch size, spelt as in every face)


def test_benchmarks_and_results_stay_few() -> None:
    root = PACKAGE.parent
    assert len(list((root / "benchmarks").glob("*.py"))) <= 8
    assert len([p for p in (root / "docs" / "results").rglob("*") if p.is_file()]) <= 86


@pytest.mark.parametrize("path", MODULES, ids=name_of)
def test_no_private_name_crosses_modules(path: Path) -> None:
    for node in runtime_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("divtrace"):
            private = [a.name for a in node.names
                       if a.name.startswith("_") and not a.name.endswith("__")]
            assert not private, f"{name_of(path)} imports {private} from {node.module}"


def test_no_import_cycle() -> None:
    known = {name_of(p) for p in MODULES}
    graph: dict[str, set[str]] = {name: set() for name in known}
    for path in MODULES:
        for node in runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in node.names]
            else:
                targets = [a.name for a in node.names]
            graph[name_of(path)].update(t for t in targets if t in known and t != "divtrace")
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            raise AssertionError("import cycle: " + " -> ".join([*trail, name]))
        if name in done:
            return
        for target in graph[name]:
            visit(target, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert done == known


PRIVATE_TORCH = re.compile(r"torch\.utils\._pytree|torch\.testing\._|\._version\b|"
                           r"torch\._foreach|_BatchNorm|_DropoutNd")


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "compat.py"], ids=name_of)
def test_private_torch_apis_only_in_compat(path: Path) -> None:
    code = " ".join(tok.string for tok in tokenize.generate_tokens(
        io.StringIO(path.read_text()).readline) if tok.type != tokenize.STRING)
    assert not PRIVATE_TORCH.search(code), PRIVATE_TORCH.search(code)


def test_every_column_is_documented() -> None:
    import divtrace
    from divtrace.measure.fields import FIELDS
    from divtrace.measure.figures import FIGURES

    readme = (PACKAGE.parent / "docs" / "guide.md").read_text()  # the column reference
    columns = [*divtrace.COLUMNS, *(c for cs in divtrace.EXPLAIN_COLUMNS.values() for c in cs)]
    assert [c for c in columns if f"`{c}`" not in readme] == []
    assert all(entry.doc for entry in (*FIELDS, *FIGURES))


#: The layers, in the pipeline's order: a module imports only from its own layer or
#: earlier ones (every import, those for typing and those inside functions included).
LAYERS = ("base", "align", "plan", "record", "measure", "kinds", "explain", "report",
          "faces")
BASE = {"errors", "words", "compat", "progress", "version", "devices"}
def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "faces"
    if parts[1] in BASE:
        return "base"
    return parts[1] if parts[1] in LAYERS else "faces"


def test_imports_follow_the_layers() -> None:
    against = set()
    for path in MODULES:
        own = layer_of(name_of(path))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("divtrace") and (
                        LAYERS.index(layer_of(target)) > LAYERS.index(own)):
                    against.add((name_of(path), target))
    assert not against, sorted(against)


#: Where each kind may be named besides its own file and the registry: a kind derived
#: from it, and the fixed-batch remedy's replay, which is of the padded kind.
KIND_USERS = {"Sharded": set(), "OnRanks": set(), "TwoModels": {"divtrace.kinds.sharded"},
              "Ragged": {"divtrace.kinds.decode", "divtrace.kinds.tokens",
                         "divtrace.kinds.compiled"},
              "Padded": {"divtrace.remedies.search"},
              "Accumulation": {"divtrace.accumulation"},
              "DecodeStep": {"divtrace.generate.result"}, "Tokens": {"divtrace.layouts"},
              "CompiledRegions": {"divtrace.compiled"}}
#: The types a kind is told by, asked for only in the kinds and where they are defined.
KIND_TYPES = {"RaggedInput": {"divtrace.plan.prompts", "divtrace.plan.tokens"},
              "OtherModel": {"divtrace.plan.other"}}


def test_each_kind_is_one_file() -> None:
    from divtrace.kinds.registry import GIVEN, KINDS

    kinds = {kind.__name__: kind.__module__ for kind in (*KINDS, *GIVEN) if kind.__name__ != "Kind"}
    assert set(kinds) == set(KIND_USERS)
    named: dict[str, set[str]] = {name: set() for name in kinds}
    asked: dict[str, set[str]] = {name: set() for name in KIND_TYPES}
    for path in MODULES:
        module = name_of(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id in named:
                named[node.id].add(module)
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance":
                for name in KIND_TYPES:
                    if name in ast.unparse(node.args[1]):
                        asked[name].add(module)
    for name, module in kinds.items():
        assert named[name] <= {module, "divtrace.kinds.registry", *KIND_USERS[name]}, name
    for name, users in asked.items():
        assert all(m.startswith("divtrace.kinds.") or m in KIND_TYPES[name] for m in users), (
            name, users)


def test_the_architecture_page_is_short() -> None:
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    assert len(page.splitlines()) < 200  # a newcomer's page; the detail in internals.md
    assert "internals.md" in page


def test_the_probe_seam_is_narrow() -> None:
    import divtrace

    members = sorted(name for name in vars(divtrace.Probe) if not name.startswith("_"))
    assert members == ["check", "explain", "fill", "hooks", "label", "note", "settings", "spec"]
    assert len(members) <= 8
    # what a probe is read from its spec; no probe in the package sets the old attributes
    old = {"name", "default", "columns", "shown", "leads", "passes", "blank", "whole_batch",
           "keeps_batched", "prints_batched", "sentences", "findings", "by_default",
           "before", "start", "on_site", "on_call", "after"}
    from divtrace.explain.registry import PROBES

    for probe in PROBES:
        assert not old & set(vars(probe)), (probe.__name__, old & set(vars(probe)))
    # the core asks a probe's spec, not its type: it names no probe
    for module in ("assembly.py", "pipeline.py"):
        tree = ast.parse((PACKAGE / module).read_text())
        named = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        assert not named & {probe.__name__ for probe in PROBES}, module
