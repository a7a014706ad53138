from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SequenceHeader(_message.Message):
    __slots__ = ("seq_id", "temperature", "top_p", "top_k", "seeds", "lengths", "pipeline", "epoch", "scheme", "tree_width", "limit", "approximate_json", "constraint_json")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    TREE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    APPROXIMATE_JSON_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_JSON_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    temperature: float
    top_p: float
    top_k: int
    seeds: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    pipeline: bool
    epoch: int
    scheme: str
    tree_width: int
    limit: int
    approximate_json: str
    constraint_json: str
    def __init__(self, seq_id: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seeds: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ..., pipeline: _Optional[bool] = ..., epoch: _Optional[int] = ..., scheme: _Optional[str] = ..., tree_width: _Optional[int] = ..., limit: _Optional[int] = ..., approximate_json: _Optional[str] = ..., constraint_json: _Optional[str] = ...) -> None: ...

class Rows(_message.Message):
    __slots__ = ("encoding", "num_rows", "vocab", "dense", "counts", "indices", "values", "dist_tag", "dist_src")
    class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NONE: _ClassVar[Rows.Encoding]
        INLINE: _ClassVar[Rows.Encoding]
        SPARSE: _ClassVar[Rows.Encoding]
        DIST: _ClassVar[Rows.Encoding]
    NONE: Rows.Encoding
    INLINE: Rows.Encoding
    SPARSE: Rows.Encoding
    DIST: Rows.Encoding
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    DIST_TAG_FIELD_NUMBER: _ClassVar[int]
    DIST_SRC_FIELD_NUMBER: _ClassVar[int]
    encoding: Rows.Encoding
    num_rows: int
    vocab: int
    dense: bytes
    counts: _containers.RepeatedScalarFieldContainer[int]
    indices: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    dist_tag: int
    dist_src: int
    def __init__(self, encoding: _Optional[_Union[Rows.Encoding, str]] = ..., num_rows: _Optional[int] = ..., vocab: _Optional[int] = ..., dense: _Optional[bytes] = ..., counts: _Optional[_Iterable[int]] = ..., indices: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[float]] = ..., dist_tag: _Optional[int] = ..., dist_src: _Optional[int] = ...) -> None: ...

class StageReport(_message.Message):
    __slots__ = ("tier", "drafter", "length", "proposed", "accepted", "seconds", "ahead", "block_seconds")
    TIER_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tier: int
    drafter: int
    length: int
    proposed: int
    accepted: int
    seconds: float
    ahead: bool
    block_seconds: float
    def __init__(self, tier: _Optional[int] = ..., drafter: _Optional[int] = ..., length: _Optional[int] = ..., proposed: _Optional[int] = ..., accepted: _Optional[int] = ..., seconds: _Optional[float] = ..., ahead: _Optional[bool] = ..., block_seconds: _Optional[float] = ...) -> None: ...

class ContextDelta(_message.Message):
    __slots__ = ("version", "base_version", "base_len")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    version: int
    base_version: int
    base_len: int
    def __init__(self, version: _Optional[int] = ..., base_version: _Optional[int] = ..., base_len: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("header", "context", "num_tokens", "tree", "caller", "accept_dist", "delta")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_DIST_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    header: SequenceHeader
    context: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    tree: bool
    caller: int
    accept_dist: bool
    delta: ContextDelta
    def __init__(self, header: _Optional[_Union[SequenceHeader, _Mapping]] = ..., context: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., tree: _Optional[bool] = ..., caller: _Optional[int] = ..., accept_dist: _Optional[bool] = ..., delta: _Optional[_Union[ContextDelta, _Mapping]] = ...) -> None: ...

class DraftReply(_message.Message):
    __slots__ = ("tokens", "parents", "rows", "model_s", "ahead_hit", "stages", "degraded", "continues")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    MODEL_S_FIELD_NUMBER: _ClassVar[int]
    AHEAD_HIT_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    CONTINUES_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    rows: Rows
    model_s: float
    ahead_hit: bool
    stages: _containers.RepeatedCompositeFieldContainer[StageReport]
    degraded: bool
    continues: bool
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., rows: _Optional[_Union[Rows, _Mapping]] = ..., model_s: _Optional[float] = ..., ahead_hit: _Optional[bool] = ..., stages: _Optional[_Iterable[_Union[StageReport, _Mapping]]] = ..., degraded: _Optional[bool] = ..., continues: _Optional[bool] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("header", "context", "max_tokens", "delta")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    header: SequenceHeader
    context: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    delta: ContextDelta
    def __init__(self, header: _Optional[_Union[SequenceHeader, _Mapping]] = ..., context: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., delta: _Optional[_Union[ContextDelta, _Mapping]] = ...) -> None: ...

class VerifyReply(_message.Message):
    __slots__ = ("tokens", "stages", "model_s", "degraded", "degraded_reason")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    MODEL_S_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_REASON_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    stages: _containers.RepeatedCompositeFieldContainer[StageReport]
    model_s: float
    degraded: bool
    degraded_reason: str
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., stages: _Optional[_Iterable[_Union[StageReport, _Mapping]]] = ..., model_s: _Optional[float] = ..., degraded: _Optional[bool] = ..., degraded_reason: _Optional[str] = ...) -> None: ...

class VerifyBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ...) -> None: ...

class VerifyBatchReply(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[VerifyReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[VerifyReply, _Mapping]]] = ...) -> None: ...

class DraftBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[DraftRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[DraftRequest, _Mapping]]] = ...) -> None: ...

class DraftBatchReply(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[DraftReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[DraftReply, _Mapping]]] = ...) -> None: ...

class VerdictRequest(_message.Message):
    __slots__ = ("seq_id", "epoch", "base_len", "proposed", "accepted", "correction", "path", "tree")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CORRECTION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    epoch: int
    base_len: int
    proposed: int
    accepted: int
    correction: int
    path: _containers.RepeatedScalarFieldContainer[int]
    tree: bool
    def __init__(self, seq_id: _Optional[int] = ..., epoch: _Optional[int] = ..., base_len: _Optional[int] = ..., proposed: _Optional[int] = ..., accepted: _Optional[int] = ..., correction: _Optional[int] = ..., path: _Optional[_Iterable[int]] = ..., tree: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("header", "context", "delta")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    header: SequenceHeader
    context: _containers.RepeatedScalarFieldContainer[int]
    delta: ContextDelta
    def __init__(self, header: _Optional[_Union[SequenceHeader, _Mapping]] = ..., context: _Optional[_Iterable[int]] = ..., delta: _Optional[_Union[ContextDelta, _Mapping]] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("seq_id", "length")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    length: int
    def __init__(self, seq_id: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq_id", "keep_caches")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_CACHES_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    keep_caches: bool
    def __init__(self, seq_id: _Optional[int] = ..., keep_caches: _Optional[bool] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TransportCounters(_message.Message):
    __slots__ = ("transport", "messages", "bytes")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    transport: str
    messages: int
    bytes: int
    def __init__(self, transport: _Optional[str] = ..., messages: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("tier", "index", "vocab_size", "max_context", "can_verify", "deterministic_drafts", "lower", "busy_s", "uptime_s", "forwards", "open_sequences", "sent", "ahead_hits", "ahead_misses", "ahead_dropped_tokens", "device", "pid", "stale_contexts", "context_resends")
    TIER_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CAN_VERIFY_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    LOWER_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    OPEN_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    AHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_MISSES_FIELD_NUMBER: _ClassVar[int]
    AHEAD_DROPPED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STALE_CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_RESENDS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    index: int
    vocab_size: int
    max_context: int
    can_verify: bool
    deterministic_drafts: bool
    lower: str
    busy_s: float
    uptime_s: float
    forwards: int
    open_sequences: int
    sent: _containers.RepeatedCompositeFieldContainer[TransportCounters]
    ahead_hits: int
    ahead_misses: int
    ahead_dropped_tokens: int
    device: str
    pid: int
    stale_contexts: int
    context_resends: int
    def __init__(self, tier: _Optional[str] = ..., index: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., can_verify: _Optional[bool] = ..., deterministic_drafts: _Optional[bool] = ..., lower: _Optional[str] = ..., busy_s: _Optional[float] = ..., uptime_s: _Optional[float] = ..., forwards: _Optional[int] = ..., open_sequences: _Optional[int] = ..., sent: _Optional[_Iterable[_Union[TransportCounters, _Mapping]]] = ..., ahead_hits: _Optional[int] = ..., ahead_misses: _Optional[int] = ..., ahead_dropped_tokens: _Optional[int] = ..., device: _Optional[str] = ..., pid: _Optional[int] = ..., stale_contexts: _Optional[int] = ..., context_resends: _Optional[int] = ...) -> None: ...

class ProfileRequest(_message.Message):
    __slots__ = ("context_len", "max_tokens", "repeats", "max_draft", "temperature", "top_p", "top_k", "tree_width", "scheme", "prefill_lens", "max_batch")
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TREE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    context_len: int
    max_tokens: int
    repeats: int
    max_draft: int
    temperature: float
    top_p: float
    top_k: int
    tree_width: int
    scheme: str
    prefill_lens: _containers.RepeatedScalarFieldContainer[int]
    max_batch: int
    def __init__(self, context_len: _Optional[int] = ..., max_tokens: _Optional[int] = ..., repeats: _Optional[int] = ..., max_draft: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., tree_width: _Optional[int] = ..., scheme: _Optional[str] = ..., prefill_lens: _Optional[_Iterable[int]] = ..., max_batch: _Optional[int] = ...) -> None: ...

class GridCost(_message.Message):
    __slots__ = ("batch", "width", "ms")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    batch: int
    width: int
    ms: float
    def __init__(self, batch: _Optional[int] = ..., width: _Optional[int] = ..., ms: _Optional[float] = ...) -> None: ...

class ProfileReply(_message.Message):
    __slots__ = ("forward_ms", "draft_ms", "can_verify", "deterministic_drafts", "prefill_ms", "batched", "lookup_ms", "catch_up_ms")
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    CAN_VERIFY_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    BATCHED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MS_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_MS_FIELD_NUMBER: _ClassVar[int]
    forward_ms: _containers.RepeatedScalarFieldContainer[float]
    draft_ms: _containers.RepeatedScalarFieldContainer[float]
    can_verify: bool
    deterministic_drafts: bool
    prefill_ms: _containers.RepeatedScalarFieldContainer[float]
    batched: _containers.RepeatedCompositeFieldContainer[GridCost]
    lookup_ms: float
    catch_up_ms: float
    def __init__(self, forward_ms: _Optional[_Iterable[float]] = ..., draft_ms: _Optional[_Iterable[float]] = ..., can_verify: _Optional[bool] = ..., deterministic_drafts: _Optional[bool] = ..., prefill_ms: _Optional[_Iterable[float]] = ..., batched: _Optional[_Iterable[_Union[GridCost, _Mapping]]] = ..., lookup_ms: _Optional[float] = ..., catch_up_ms: _Optional[float] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("context", "temperature", "seq_id", "delta")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    context: _containers.RepeatedScalarFieldContainer[int]
    temperature: float
    seq_id: int
    delta: ContextDelta
    def __init__(self, context: _Optional[_Iterable[int]] = ..., temperature: _Optional[float] = ..., seq_id: _Optional[int] = ..., delta: _Optional[_Union[ContextDelta, _Mapping]] = ...) -> None: ...

class ScoreReply(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: Rows
    def __init__(self, rows: _Optional[_Union[Rows, _Mapping]] = ...) -> None: ...
