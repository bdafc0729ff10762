"""The package's floors: each folder imports only the folders below it; the engines are reached through one door.

From the ground up (:data:`FLOORS`): ``base`` (errors and value parsers, optional-dependency checks, progress, the
supported SGLang range), ``core`` (identity, pages, the ports and policies: no engine, no torch), ``transfer`` (byte
movement: layouts, copies, lanes, the layer counter), ``tiers`` (host, disk, Mooncake, object; the block format, the
registry), ``config`` (every variable, each tier's from its folder), ``manager`` (one worker's tiers: the way down
and back up), ``observe`` (metrics and endpoints), ``integration`` (SGLang and Dynamo), ``ops`` (command line,
doctor, demo), and the package's own ``__init__`` on top. No two modules import each other either.
"""

import ast
import subprocess
import sys
from pathlib import Path

import sglang_kvbm


def printed_by(*lines: str) -> str:
    """What a fresh interpreter prints running ``lines`` (imports measured in a process of their own)."""
    out = subprocess.run([sys.executable, "-c", "\n".join(("import sys", *lines))], capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


FLOORS = ("base", "core", "transfer", "tiers", "config", "manager", "observe", "integration", "ops", "")
ENGINES = ("sglang", "dynamo", "kvbm")


def floor_of(module: str) -> int:
    """A module's floor: its folder's place in :data:`FLOORS` (the package's ``__init__``: the top)."""
    parts = module.split(".")
    return FLOORS.index(parts[1] if len(parts) > 1 else "")


def test_core_imports_no_engine():
    assert printed_by(
        "import sglang_kvbm.core.connector, sglang_kvbm.core.identity, sglang_kvbm.core.lifecycle",
        "import sglang_kvbm.core.offload_filter, sglang_kvbm.core.onboard_policy, sglang_kvbm.config",
        "print([m for m in ('sglang', 'kvbm', 'zmq', 'torch', 'nixl') if m in sys.modules])",
    ) == "[]"


def test_plugin_registration_imports_nothing_heavy():
    assert printed_by(
        "import sglang_kvbm.integration.sglang.plugin",
        "print([m for m in ('torch', 'zmq', 'nixl', 'sglang_kvbm.integration.sglang.radix_cache') if m in sys.modules])",
    ) == "[]"


def test_the_gpu_path_imports_torch_and_this_package_only():
    """tests/gpu runs on machines with PyTorch and nothing else: the copy engine, the loader and the layer
    counter must not pull SGLang, NIXL or any other dependency in."""
    assert printed_by(
        "import torch",
        "before = set(sys.modules)",
        "import sglang_kvbm.manager.block_manager, sglang_kvbm.manager.layer_loader",
        "import sglang_kvbm.transfer.layer_counter, sglang_kvbm.transfer.cuda_copies, sglang_kvbm.transfer.kv_layout",
        "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} - {'sglang_kvbm'}))",
    ) == "[]"


def _imports() -> dict[str, set[str]]:
    """Every module of the package -> the package's modules it imports, from every import statement (those in
    functions and under ``TYPE_CHECKING`` too: they tie the modules together all the same)."""
    root = Path(sglang_kvbm.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if package else parts)] = (path, package)
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, package) in modules.items():
        here = name if package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    base = here
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    source = f"{base}.{source}" if source else base
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    edges[name].add(target if target in modules else source)
        edges[name] &= modules.keys()
        edges[name].discard(name)
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back():
    assert _circles(_imports()) == []


def test_the_floor_finder_knows_every_folder():
    root = Path(sglang_kvbm.__file__).parent
    folders = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(FLOORS) - {""}, "a new folder needs its place in FLOORS (and in docs/architecture.md)"


def test_no_import_runs_up_a_floor():
    upward = sorted(f"{a} -> {b}" for a, targets in _imports().items() for b in targets if floor_of(b) > floor_of(a))
    assert upward == [], f"imports that run up a floor (FLOORS = {FLOORS}): move the module or what it needs"


def _engine_imports(path: Path) -> list[str]:
    """The SGLang, Dynamo and KVBM modules ``path`` imports, or names as a string (``"dynamo.sglang" in
    sys.modules``, ``python -m sglang.launch_server``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.append(node.module or "")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and " " not in node.value:
            found += [node.value] if node.value.startswith(("sglang.", "dynamo.")) else []
    return [name for name in found if name.split(".")[0] in ENGINES]


def test_only_integration_reads_or_patches_an_engine():
    """SGLang and Dynamo are reached through ``integration/sglang`` and ``integration/dynamo`` only. The demo runs
    SGLang as a program (``python -m sglang.launch_server``), which is the one name allowed outside."""
    root = Path(sglang_kvbm.__file__).parent
    outside = {str(p.relative_to(root)): _engine_imports(p) for p in root.rglob("*.py")}
    outside = {path: names for path, names in outside.items()
               if names and not path.startswith("integration/") and names != ["sglang.launch_server"]}
    assert outside == {}
    for engine, door in (("sglang", "integration/sglang/"), ("dynamo", "integration/dynamo/")):
        strays = [str(p.relative_to(root)) for p in (root / "integration").rglob("*.py")
                  if not str(p.relative_to(root)).startswith(door)
                  and any(n.split(".")[0] == engine for n in _engine_imports(p))]
        assert strays == [], f"{engine} is read outside {door}"
