"""Regenerate the committed Python stubs of the ``.proto`` files: ``python -m proto.generate``.

protoc names imports after the proto path (``from sluice.v1 import common_pb2``),
which only resolves with ``proto/`` itself on ``sys.path``; the stubs are rewritten
here to package imports (``from proto.sluice.v1 import ...``) so that the output is
importable as is and regenerating is reproducible. The drift test runs
:func:`generate` into a temporary directory and compares with the committed files.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = Path("sluice") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

# `from sluice.v1 import x_pb2` and `import sluice.v1.x_pb2` as protoc writes them.
_FROM_IMPORT = re.compile(r"^from sluice\.v1 import ", re.MULTILINE)
_PLAIN_IMPORT = re.compile(r"^import sluice\.v1\.", re.MULTILINE)


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """The ``.proto`` sources, relative to ``root`` (the proto path), sorted."""
    return sorted(p.relative_to(root) for p in (root / PACKAGE_DIR).glob("*.proto"))


def well_known_protos_dir() -> Path:
    """grpc_tools' bundled ``google/protobuf/*.proto``, for imports of well-known types."""
    return Path(str(resources.files("grpc_tools") / "_proto"))


def run_protoc(args: list[str]) -> None:
    from grpc_tools import protoc  # test-only dependency; imported where needed

    code = protoc.main(["grpc_tools.protoc", *args])
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}: {' '.join(args)}")


def generate(out_dir: Path, root: Path = PROTO_ROOT) -> list[Path]:
    """Compile every ``.proto`` under ``root`` into ``out_dir``; return the stub paths written."""
    (out_dir / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    for stale in generated_files(out_dir):  # stubs of a removed .proto must not linger
        stale.unlink()
    sources = [str(p) for p in proto_files(root)]
    if not sources:
        raise FileNotFoundError(f"no .proto files under {root / PACKAGE_DIR}")
    run_protoc([
        f"--proto_path={root}",
        f"--proto_path={well_known_protos_dir()}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *sources,
    ])
    written = generated_files(out_dir)
    for path in written:
        path.write_text(fix_imports(path.read_text()))
    return written


def generated_files(base: Path) -> list[Path]:
    """The stub files under ``base/sluice/v1``, sorted."""
    package = base / PACKAGE_DIR
    return sorted(p for p in package.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def fix_imports(source: str) -> str:
    source = _FROM_IMPORT.sub("from proto.sluice.v1 import ", source)
    return _PLAIN_IMPORT.sub("import proto.sluice.v1.", source)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT,
                        help="directory to write sluice/v1/*_pb2*.py into (default: proto/)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
