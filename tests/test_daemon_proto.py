"""The committed gRPC modules in dart_client/ngram/proto/ are exactly what the .proto generates, and
the client's configuration message covers every pruner setting."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from dart_client.ngram import protogen


def test_regenerating_the_proto_modules_yields_the_committed_files(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) regenerates")
    written = protogen.generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(protogen.GENERATED)
    for path in written:
        committed = protogen.OUT_DIR / path.name
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run `python -m dart_client.ngram.protogen`"
        )


def test_generated_grpc_module_imports_from_the_package() -> None:
    from dart_client.ngram.proto import ngram_pb2, ngram_pb2_grpc

    text = (protogen.OUT_DIR / "ngram_pb2_grpc.py").read_text()
    assert "from dart.ngram" not in text
    assert ngram_pb2.DESCRIPTOR.package == "dart.ngram.v1"
    service = ngram_pb2.DESCRIPTOR.services_by_name["NGramService"]
    assert {m.name for m in service.methods} == {
        "Info",
        "Prob",
        "Count",
        "TopK",
        "Prune",
        "PruneBatch",
    }
    assert hasattr(ngram_pb2_grpc, "NGramServiceStub")


def test_every_pruner_setting_travels_to_the_daemon() -> None:
    from dart_client.ngram.proto import ngram_pb2
    from dart_client.ngram.pruner import PrunerConfig

    wire = set(ngram_pb2.PrunerConfig.DESCRIPTOR.fields_by_name)
    assert {f.name for f in fields(PrunerConfig)} == wire
