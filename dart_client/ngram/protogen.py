"""Regenerates ``dart_client/ngram/proto/`` from ``proto/dart/ngram/v1/ngram.proto`` (grpcio-tools).

The generated modules are committed so installing the package needs no protobuf compiler;
``tests/test_daemon_proto.py`` checks that regenerating yields identical files. Run after
editing the .proto::

    python -m dart_client.ngram.protogen

The generated files sit flat in ``dart_client/ngram/proto/``; the gRPC module's import of its
message module is rewritten to that location (grpcio-tools writes it as a top-level
``dart.ngram.v1`` package import).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "proto"
PROTO_FILE = "dart/ngram/v1/ngram.proto"
OUT_DIR = Path(__file__).resolve().parent / "proto"
GENERATED = ("ngram_pb2.py", "ngram_pb2.pyi", "ngram_pb2_grpc.py")
_IMPORT_AS_GENERATED = "from dart.ngram.v1 import ngram_pb2 as"
_IMPORT_IN_PACKAGE = "from dart_client.ngram.proto import ngram_pb2 as"


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    """Compiles the .proto into ``out_dir``; returns the files written."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    src = PROTO_ROOT / PROTO_FILE
    if not src.is_file():
        raise FileNotFoundError(f"{src}: the .proto is missing (run from a source checkout)")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(src),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"grpc_tools.protoc failed on {src} with exit status {rc}")
        written = []
        for name in GENERATED:
            text = (Path(tmp) / "dart/ngram/v1" / name).read_text(encoding="utf-8")
            if name.endswith("_grpc.py"):
                if _IMPORT_AS_GENERATED not in text:
                    raise RuntimeError(
                        f"{name}: expected the line {_IMPORT_AS_GENERATED!r}; grpcio-tools "
                        "changed its output, update dart_client/ngram/protogen.py"
                    )
                text = text.replace(_IMPORT_AS_GENERATED, _IMPORT_IN_PACKAGE)
            dst = out_dir / name
            dst.write_text(text, encoding="utf-8")
            written.append(dst)
    return written


def main() -> int:
    for path in generate():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
