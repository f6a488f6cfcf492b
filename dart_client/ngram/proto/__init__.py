"""Generated gRPC code of the n-gram daemon's contract (``proto/dart/ngram/v1/ngram.proto``).

Do not edit the ``ngram_pb2*`` modules: regenerate them with ``python -m dart_client.ngram.protogen``.
"""
