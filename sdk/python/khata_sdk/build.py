"""Builds a handler into a khata plugin component.

Usage::

    python -m khata_sdk.build handler.py -o welcome_email.wasm

The handler is a Python module whose function is marked with
``@khata_sdk.handler``; modules next to it (its directory is on the
component's path) may be imported too. The component imports the khata
interfaces whose ``khata_sdk`` modules the handler's files import
(``from khata_sdk import kv, email`` → kv and email), plus ``log``, which
needs no grant; ``--imports kv,email`` names them instead. A queue must be
granted every one of them, or the daemon refuses the plugin.

The build runs componentize-py (pinned by this package) on a world made for
the handler from the WIT in ``--wit`` (default: ``$KHATA_WIT``, else the
khata repository's ``wit/`` when this package is used from a checkout), and
writes the output through a temporary file, so that a daemon watching the
output's directory never loads half a component.
"""

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: The khata interfaces a component may import, in WIT order.
INTERFACES = ("kv", "index", "email", "http", "log")
#: Directories under the handler's directory that are not its code.
SKIP_DIRS = {"__pycache__", "venv", ".venv", "node_modules", "build", "dist", "target"}
WORLD = "handler-build"
#: componentize-py's command line, run by the interpreter that runs the build.
COMPONENTIZE_PY = (
    "import sys, componentize_py; sys.argv[0] = 'componentize-py'; componentize_py.script()"
)


class BuildError(Exception):
    """A build that cannot go on; the message says what to change."""


def default_wit() -> Path:
    """Where the WIT is when ``--wit`` is not given."""
    if os.environ.get("KHATA_WIT"):
        return Path(os.environ["KHATA_WIT"])
    return Path(__file__).resolve().parents[3] / "wit"


def handler_files(handler: Path):
    """The ``.py`` files of the handler: its own, and those under its
    directory (not hidden, not virtualenvs or build output)."""
    yield handler
    for root, dirs, files in os.walk(handler.parent):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        for name in sorted(files):
            path = Path(root) / name
            if name.endswith(".py") and path != handler:
                yield path


def used_interfaces(source: str, filename: str) -> set:
    """The khata interfaces ``source`` imports through ``khata_sdk``."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as e:
        raise BuildError(f"{filename}:{e.lineno}:{e.offset}: {e.msg}") from None
    used, aliases = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] != "khata_sdk":
                    continue
                if len(parts) > 1 and parts[1] in INTERFACES:
                    used.add(parts[1])
                elif len(parts) == 1:
                    aliases.add(alias.asname or "khata_sdk")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] != "khata_sdk":
                continue
            if len(parts) > 1 and parts[1] in INTERFACES:
                used.add(parts[1])
            elif len(parts) == 1:
                for alias in node.names:
                    if alias.name == "*":
                        raise BuildError(
                            f"{filename}:{node.lineno}: `from khata_sdk import *` hides "
                            f"which effects the handler uses; import them by name "
                            f"(`from khata_sdk import kv, email`)"
                        )
                    if alias.name in INTERFACES:
                        used.add(alias.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr in INTERFACES
        ):
            used.add(node.attr)
    return used


def world_source(package_line: str, imports) -> str:
    """A world like ``handler`` that imports only ``imports``."""
    lines = [package_line, "", f"world {WORLD} {{"]
    lines += [f"  import {name};" for name in INTERFACES if name in imports]
    lines += [
        "  use types.{job, job-error};",
        "  export handle: func(job: job) -> result<string, job-error>;",
        "}",
        "",
    ]
    return "\n".join(lines)


def package_line(wit: Path) -> str:
    """The ``package ...;`` line of the WIT in directory ``wit``."""
    for path in sorted(wit.glob("*.wit")):
        for line in path.read_text().splitlines():
            if line.strip().startswith("package "):
                return line.strip()
    raise BuildError(f"{wit}: no .wit file with a `package` line; pass --wit DIR")


def build(handler: Path, output: Path, wit: Path, imports=None, verbose=False) -> list:
    """Builds ``handler`` into the component ``output``; returns the khata
    interfaces it imports. ``output`` is complete when this returns (it is
    renamed into place)."""
    handler = handler.resolve()
    if not handler.is_file() or handler.suffix != ".py":
        raise BuildError(f"{handler}: not a Python file")
    if not handler.stem.isidentifier():
        raise BuildError(f"{handler}: the file name must be a Python module name")
    if not wit.is_dir():
        raise BuildError(f"{wit}: no such WIT directory; pass --wit DIR or set KHATA_WIT")
    if imports is None:
        imports = set()
        for path in handler_files(handler):
            imports |= used_interfaces(path.read_text(), str(path))
    imports = set(imports) | {"log"}
    unknown = imports - set(INTERFACES)
    if unknown:
        raise BuildError(
            f"--imports: unknown interface {', '.join(sorted(unknown))} "
            f"(known: {', '.join(INTERFACES)})"
        )
    with tempfile.TemporaryDirectory(prefix="khata-build-") as tmp:
        tmp = Path(tmp)
        shutil.copytree(wit, tmp / "wit")
        (tmp / "wit" / "khata-build-world.wit").write_text(
            world_source(package_line(wit), imports)
        )
        code = tmp / "code"
        shutil.copytree(
            Path(__file__).resolve().parent,
            code / "khata_sdk",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        # Everything the handler may import at run time is imported here, at
        # build time: the component starts from a snapshot taken after this
        # module ran, and a sandbox without files cannot import more later.
        preload = "".join(f"import wit_world.imports.{name}\n" for name in sorted(imports))
        (code / "khata_build_entry.py").write_text(
            f"{preload}"
            "import componentize_py_types\n"
            f"import {handler.stem}  # marks the handler\n"
            "from khata_sdk._export import WitWorld\n"
        )
        partial = output.with_name(f".{output.name}.partial")
        command = [
            sys.executable, "-c", COMPONENTIZE_PY,
            "-d", str(tmp / "wit"), "-w", WORLD,
            "componentize", "khata_build_entry",
            "-p", str(code), "-p", str(handler.parent),
            "-o", str(partial),
        ]
        done = subprocess.run(command, capture_output=not verbose, text=True)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            # componentize-py appends its own stack to the Python error.
            output = f"{done.stdout}{done.stderr}".split("\nStack backtrace:")[0]
            detail = "" if verbose else f"\n{output}".rstrip()
            raise BuildError(f"componentize-py failed on {handler}{detail}")
        os.replace(partial, output)
    return [name for name in INTERFACES if name in imports]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m khata_sdk.build",
        description="Build a Python handler into a khata plugin component.",
    )
    parser.add_argument("handler", type=Path, help="the handler's module, such as handler.py")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the .wasm to write")
    parser.add_argument("--wit", type=Path, default=None, help="the khata WIT directory")
    parser.add_argument(
        "--imports",
        default=None,
        help="the khata interfaces to import, comma-separated "
        "(default: those the handler imports from khata_sdk)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show componentize-py's output")
    args = parser.parse_args(argv)
    imports = None
    if args.imports is not None:
        imports = {name.strip() for name in args.imports.split(",") if name.strip()}
    try:
        used = build(args.handler, args.output, args.wit or default_wit(), imports, args.verbose)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = args.output.stat().st_size
    print(f"built {args.output} ({size} bytes), importing khata {', '.join(used)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
