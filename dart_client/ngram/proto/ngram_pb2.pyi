from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("order", "vocab_size", "tokenizer_fingerprint", "eos_id", "total_tokens", "info_json", "server_version")
    ORDER_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EOS_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    order: int
    vocab_size: int
    tokenizer_fingerprint: bytes
    eos_id: int
    total_tokens: int
    info_json: str
    server_version: str
    def __init__(self, order: _Optional[int] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[bytes] = ..., eos_id: _Optional[int] = ..., total_tokens: _Optional[int] = ..., info_json: _Optional[str] = ..., server_version: _Optional[str] = ...) -> None: ...

class TokenRows(_message.Message):
    __slots__ = ("tokens", "lengths")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class ProbRequest(_message.Message):
    __slots__ = ("contexts", "candidates")
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    contexts: TokenRows
    candidates: TokenRows
    def __init__(self, contexts: _Optional[_Union[TokenRows, _Mapping]] = ..., candidates: _Optional[_Union[TokenRows, _Mapping]] = ...) -> None: ...

class ProbResponse(_message.Message):
    __slots__ = ("probs", "matched")
    PROBS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    matched: bytes
    def __init__(self, probs: _Optional[_Iterable[float]] = ..., matched: _Optional[bytes] = ...) -> None: ...

class CountRequest(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: TokenRows
    def __init__(self, sequences: _Optional[_Union[TokenRows, _Mapping]] = ...) -> None: ...

class CountResponse(_message.Message):
    __slots__ = ("counts",)
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, counts: _Optional[_Iterable[int]] = ...) -> None: ...

class TopKRequest(_message.Message):
    __slots__ = ("contexts", "k")
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    contexts: TokenRows
    k: int
    def __init__(self, contexts: _Optional[_Union[TokenRows, _Mapping]] = ..., k: _Optional[int] = ...) -> None: ...

class TopKResponse(_message.Message):
    __slots__ = ("ids", "probs", "lengths")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class PrunerConfig(_message.Message):
    __slots__ = ("top_k", "beam_width", "max_nodes", "level_exponent", "logit_decay", "ngram_weight", "ngram_at_level0", "eos_id", "eps")
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    LEVEL_EXPONENT_FIELD_NUMBER: _ClassVar[int]
    LOGIT_DECAY_FIELD_NUMBER: _ClassVar[int]
    NGRAM_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    NGRAM_AT_LEVEL0_FIELD_NUMBER: _ClassVar[int]
    EOS_ID_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    top_k: int
    beam_width: int
    max_nodes: int
    level_exponent: float
    logit_decay: float
    ngram_weight: float
    ngram_at_level0: bool
    eos_id: int
    eps: float
    def __init__(self, top_k: _Optional[int] = ..., beam_width: _Optional[int] = ..., max_nodes: _Optional[int] = ..., level_exponent: _Optional[float] = ..., logit_decay: _Optional[float] = ..., ngram_weight: _Optional[float] = ..., ngram_at_level0: _Optional[bool] = ..., eos_id: _Optional[int] = ..., eps: _Optional[float] = ...) -> None: ...

class Draft(_message.Message):
    __slots__ = ("context", "topk_ids", "topk_probs", "levels", "k", "budget", "lookup_path")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROBS_FIELD_NUMBER: _ClassVar[int]
    LEVELS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_PATH_FIELD_NUMBER: _ClassVar[int]
    context: _containers.RepeatedScalarFieldContainer[int]
    topk_ids: _containers.RepeatedScalarFieldContainer[int]
    topk_probs: _containers.RepeatedScalarFieldContainer[float]
    levels: int
    k: int
    budget: int
    lookup_path: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, context: _Optional[_Iterable[int]] = ..., topk_ids: _Optional[_Iterable[int]] = ..., topk_probs: _Optional[_Iterable[float]] = ..., levels: _Optional[int] = ..., k: _Optional[int] = ..., budget: _Optional[int] = ..., lookup_path: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("tokens", "parents", "depths", "attention_mask", "retrieve_indices", "retrieve_rows", "retrieve_cols", "scores")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MASK_FIELD_NUMBER: _ClassVar[int]
    RETRIEVE_INDICES_FIELD_NUMBER: _ClassVar[int]
    RETRIEVE_ROWS_FIELD_NUMBER: _ClassVar[int]
    RETRIEVE_COLS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    depths: _containers.RepeatedScalarFieldContainer[int]
    attention_mask: bytes
    retrieve_indices: _containers.RepeatedScalarFieldContainer[int]
    retrieve_rows: int
    retrieve_cols: int
    scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., depths: _Optional[_Iterable[int]] = ..., attention_mask: _Optional[bytes] = ..., retrieve_indices: _Optional[_Iterable[int]] = ..., retrieve_rows: _Optional[int] = ..., retrieve_cols: _Optional[int] = ..., scores: _Optional[_Iterable[float]] = ...) -> None: ...

class PruneRequest(_message.Message):
    __slots__ = ("draft", "config")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    draft: Draft
    config: PrunerConfig
    def __init__(self, draft: _Optional[_Union[Draft, _Mapping]] = ..., config: _Optional[_Union[PrunerConfig, _Mapping]] = ...) -> None: ...

class PruneResponse(_message.Message):
    __slots__ = ("tree",)
    TREE_FIELD_NUMBER: _ClassVar[int]
    tree: DraftTree
    def __init__(self, tree: _Optional[_Union[DraftTree, _Mapping]] = ...) -> None: ...

class PruneBatchRequest(_message.Message):
    __slots__ = ("drafts", "config")
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    drafts: _containers.RepeatedCompositeFieldContainer[Draft]
    config: PrunerConfig
    def __init__(self, drafts: _Optional[_Iterable[_Union[Draft, _Mapping]]] = ..., config: _Optional[_Union[PrunerConfig, _Mapping]] = ...) -> None: ...

class PruneBatchResponse(_message.Message):
    __slots__ = ("trees",)
    TREES_FIELD_NUMBER: _ClassVar[int]
    trees: _containers.RepeatedCompositeFieldContainer[DraftTree]
    def __init__(self, trees: _Optional[_Iterable[_Union[DraftTree, _Mapping]]] = ...) -> None: ...
