"""The import graph of the `polyspec` package: layers only import downward, no private name
crosses a module boundary. (Modules are split by concern, not by a line count.)

Layers, lowest first (a module may import its own layer and the ones below it):

    core math and wire format (workers/core, protos, the SDK client)
    <- tiers (workers/tiers) <- the config, tokenization <- decode (the decoder contract, the schedulers)
    <- tuning (goodput planner, profiler) <- distributed (worker, transport, driver, Ray)
    <- engine, the batch runner <- serving (server, request loop, jobs, metrics, HTTP), validate
    <- harness (bench, tune, zoo) <- the `polyspec` command (cli.py, __main__)

Nothing in the runtime imports polyspec.harness: only the command, which dispatches to it,
sits above it. Checked statically (ast), imports inside functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package it is installed as (pyproject.toml, [tool.setuptools.package-dir])
PACKAGE_DIRS = {"polyspec": "polyspec", "workers": "polyspec.workers", "orchestrator": "polyspec.orchestrator",
                "protos": "polyspec.protos"}
PRIVATES_CHECKED = ("polyspec", "workers", "orchestrator")  # (protos: generated code)

# module-name prefix -> layer; the longest matching prefix wins
LAYERS = {
    "polyspec.protos": 0,
    "polyspec.workers.core": 0,
    "polyspec.client": 0,
    "polyspec.workers.tiers": 1,
    "polyspec.orchestrator.config": 2,
    "polyspec.orchestrator.tokenization": 2,
    "polyspec.orchestrator.decode": 3,
    "polyspec.orchestrator.tuning": 4,
    "polyspec.orchestrator.distributed": 5,
    "polyspec.orchestrator.engine": 6,
    "polyspec.orchestrator.batch_runner": 6,
    "polyspec.orchestrator.serving": 7,
    "polyspec.orchestrator.serving_cli": 7,
    "polyspec.orchestrator.validate": 7,
    "polyspec.orchestrator.chain_args": 7,
    "polyspec.harness": 8,
    "polyspec.orchestrator.cli": 9,
    "polyspec.__main__": 9,
}
# package __init__ modules hold no code that imports other layers
PACKAGES = {"polyspec", "polyspec.workers", "polyspec.orchestrator", "polyspec.protos"}


def layer_of(module: str) -> int | None:
    matches = [prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")]
    return LAYERS[max(matches, key=len)] if matches else None


def source_modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    modules = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def imports_of(module: str, path: Path, tree: ast.Module) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names taken from it) for every import in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base, [alias.name for alias in node.names]))
    return found


def private_attributes(tree: ast.Module) -> list[tuple[int, str]]:
    """`obj._name` uses whose `_name` this module neither defines nor assigns: someone else's
    private name (`self._x` / `cls._x` are the object's own)."""
    defined = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
    used = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if node.attr not in defined and node.attr not in PUBLIC_UNDERSCORED:
            used.append((node.lineno, node.attr))
    return used


# underscored names that are not this package's privates
PUBLIC_UNDERSCORED = {
    "_replace", "_asdict", "_fields", "_make",  # namedtuple's public API
    "_packed_params",  # torch's dynamically quantized Linear keeps its int8 weights there (no public accessor)
    "_scaled_mm",  # torch's fp8 GEMM (fp8_linear); the public torch.nn.functional.scaled_mm calls a newer op, _scaled_mm_v2
    # torch's weight-only int4 / int8 kernels and their packing (weight_only): aten ops with no public wrapper
    "_weight_int8pack_mm", "_weight_int4pack_mm", "_weight_int4pack_mm_for_cpu",
    "_convert_weight_to_int4pack", "_convert_weight_to_int4pack_for_cpu",
    # an OpOverload's C++ function (batched_llama's int8 projections): its __call__ first walks the arguments in
    # Python for tracing's fake objects, ~8 us a call, 43 calls a forward of an int8 drafter; torch is pinned
    "_op",
}


def check(modules: dict[str, Path]) -> list[str]:
    problems = []
    for module, path in modules.items():
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ROOT)
        folder = where.parts[0]
        tree = ast.parse(text, filename=str(where))
        own = layer_of(module)
        if own is None and module not in PACKAGES:
            problems.append(f"{where}: module {module} has no layer (add it to LAYERS)")
            continue
        for line, imported, names in imports_of(module, path, tree):
            if imported != "polyspec" and not imported.startswith("polyspec."):
                continue
            targets = [imported] + [f"{imported}.{name}" for name in names if f"{imported}.{name}" in modules]
            for target in targets:
                layer = layer_of(target)
                if own is not None and layer is not None and layer > own:
                    problems.append(f"{where}:{line}: {module} (layer {own}) imports {target} (layer {layer})")
            for name in names:
                if name.startswith("_") and f"{imported}.{name}" not in modules and name != "__version__":
                    problems.append(f"{where}:{line}: imports the private name {name} from {imported}")
        if folder in PRIVATES_CHECKED:
            for line, name in private_attributes(tree):
                problems.append(f"{where}:{line}: uses the private name {name} of another module")
    return problems


def test_layers_only_import_downward_and_keep_their_privates():
    problems = check(source_modules())
    assert not problems, "\n".join(problems)


def test_the_check_sees_an_upward_import_and_a_private_import(tmp_path):
    """The check itself: a scheduler that imports the engine and a worker that takes a private name
    from the scheduler are each reported."""
    folder = tmp_path / "orchestrator" / "decode"
    folder.mkdir(parents=True)
    (folder / "scheduler.py").write_text("from polyspec.orchestrator.engine import Engine\n", encoding="utf-8")
    (folder / "helper.py").write_text("from polyspec.orchestrator.decode.scheduler import _Run\n"
                                      "def f(s):\n    return s._round()\n", encoding="utf-8")
    modules = {
        "polyspec.orchestrator.decode.scheduler": folder / "scheduler.py",
        "polyspec.orchestrator.decode.helper": folder / "helper.py",
    }
    problems = "\n".join(check_at(tmp_path, modules))
    assert "imports polyspec.orchestrator.engine (layer 6)" in problems
    assert "private name _Run" in problems and "private name _round" in problems


def check_at(root: Path, modules: dict[str, Path]) -> list[str]:
    global ROOT
    saved, ROOT = ROOT, root
    try:
        return check(modules)
    finally:
        ROOT = saved


@pytest.mark.parametrize("module, layer", [("polyspec.orchestrator.decode.contract", 3),
                                           ("polyspec.orchestrator.tuning.batch_model", 4),
                                           ("polyspec.harness.tune", 8)])
def test_layer_of(module, layer):
    assert layer_of(module) == layer
