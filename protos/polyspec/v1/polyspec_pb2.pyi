from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState

class GenerateRequest(_message.Message):
    __slots__ = ("id", "prompt", "prompt_ids", "messages", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "approximate_json", "n", "logprobs", "top_logprobs", "json_schema", "regex", "grammar")
    ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    APPROXIMATE_JSON_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    id: str
    prompt: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    approximate_json: str
    n: int
    logprobs: bool
    top_logprobs: int
    json_schema: str
    regex: str
    grammar: str
    def __init__(self, id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., approximate_json: _Optional[str] = ..., n: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stats", "id", "stats_json", "index", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stats: GenerationStats
    id: str
    stats_json: str
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., id: _Optional[str] = ..., stats_json: _Optional[str] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("tokens_per_s", "new_tokens", "time_s", "stages", "tiers", "queue_s", "first_token_s")
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    tokens_per_s: float
    new_tokens: int
    time_s: float
    stages: _containers.RepeatedCompositeFieldContainer[StageStats]
    tiers: _containers.RepeatedCompositeFieldContainer[TierBusy]
    queue_s: float
    first_token_s: float
    def __init__(self, tokens_per_s: _Optional[float] = ..., new_tokens: _Optional[int] = ..., time_s: _Optional[float] = ..., stages: _Optional[_Iterable[_Union[StageStats, _Mapping]]] = ..., tiers: _Optional[_Iterable[_Union[TierBusy, _Mapping]]] = ..., queue_s: _Optional[float] = ..., first_token_s: _Optional[float] = ...) -> None: ...

class StageStats(_message.Message):
    __slots__ = ("tier", "drafter", "blocks", "proposed", "accepted", "mean_accepted_length", "lengths", "accepted_counts", "time_s")
    TIER_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    tier: str
    drafter: str
    blocks: int
    proposed: int
    accepted: int
    mean_accepted_length: float
    lengths: _containers.RepeatedScalarFieldContainer[int]
    accepted_counts: _containers.RepeatedScalarFieldContainer[int]
    time_s: float
    def __init__(self, tier: _Optional[str] = ..., drafter: _Optional[str] = ..., blocks: _Optional[int] = ..., proposed: _Optional[int] = ..., accepted: _Optional[int] = ..., mean_accepted_length: _Optional[float] = ..., lengths: _Optional[_Iterable[int]] = ..., accepted_counts: _Optional[_Iterable[int]] = ..., time_s: _Optional[float] = ...) -> None: ...

class TierBusy(_message.Message):
    __slots__ = ("tier", "busy_s")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    tier: str
    busy_s: float
    def __init__(self, tier: _Optional[str] = ..., busy_s: _Optional[float] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("requests", "idempotency_key")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    idempotency_key: str
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "state", "total", "completed", "failed", "created_at", "finished_at")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    total: int
    completed: int
    failed: int
    created_at: float
    finished_at: float
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., total: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ..., created_at: _Optional[float] = ..., finished_at: _Optional[float] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class StreamJobResultsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobResult(_message.Message):
    __slots__ = ("id", "token_ids", "text", "finish_reason", "error", "stats_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    error: str
    stats_json: str
    def __init__(self, id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., error: _Optional[str] = ..., stats_json: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("stages", "speculation_lengths", "active_tiers", "tiers", "queue", "requests", "generated_tokens", "uptime_s", "ready", "draining", "plans", "recent_plans")
    STAGES_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TIERS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    RECENT_PLANS_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[StageStats]
    speculation_lengths: _containers.RepeatedScalarFieldContainer[int]
    active_tiers: _containers.RepeatedScalarFieldContainer[str]
    tiers: _containers.RepeatedCompositeFieldContainer[TierHealth]
    queue: QueueStats
    requests: RequestCounts
    generated_tokens: int
    uptime_s: float
    ready: bool
    draining: bool
    plans: _containers.RepeatedCompositeFieldContainer[ChainPlanStats]
    recent_plans: _containers.RepeatedCompositeFieldContainer[PlanRecord]
    def __init__(self, stages: _Optional[_Iterable[_Union[StageStats, _Mapping]]] = ..., speculation_lengths: _Optional[_Iterable[int]] = ..., active_tiers: _Optional[_Iterable[str]] = ..., tiers: _Optional[_Iterable[_Union[TierHealth, _Mapping]]] = ..., queue: _Optional[_Union[QueueStats, _Mapping]] = ..., requests: _Optional[_Union[RequestCounts, _Mapping]] = ..., generated_tokens: _Optional[int] = ..., uptime_s: _Optional[float] = ..., ready: _Optional[bool] = ..., draining: _Optional[bool] = ..., plans: _Optional[_Iterable[_Union[ChainPlanStats, _Mapping]]] = ..., recent_plans: _Optional[_Iterable[_Union[PlanRecord, _Mapping]]] = ...) -> None: ...

class ChainPlanStats(_message.Message):
    __slots__ = ("chain", "tiers", "rounds", "tokens", "seconds", "measured_tokens_per_s", "predicted_tokens_per_s")
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    chain: str
    tiers: _containers.RepeatedScalarFieldContainer[str]
    rounds: int
    tokens: int
    seconds: float
    measured_tokens_per_s: float
    predicted_tokens_per_s: float
    def __init__(self, chain: _Optional[str] = ..., tiers: _Optional[_Iterable[str]] = ..., rounds: _Optional[int] = ..., tokens: _Optional[int] = ..., seconds: _Optional[float] = ..., measured_tokens_per_s: _Optional[float] = ..., predicted_tokens_per_s: _Optional[float] = ...) -> None: ...

class PlanRecord(_message.Message):
    __slots__ = ("tiers", "lengths", "new_tokens", "rounds", "tokens", "seconds", "measured_tokens_per_s", "predicted_tokens_per_s")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    new_tokens: int
    rounds: int
    tokens: int
    seconds: float
    measured_tokens_per_s: float
    predicted_tokens_per_s: float
    def __init__(self, tiers: _Optional[_Iterable[str]] = ..., lengths: _Optional[_Iterable[int]] = ..., new_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., tokens: _Optional[int] = ..., seconds: _Optional[float] = ..., measured_tokens_per_s: _Optional[float] = ..., predicted_tokens_per_s: _Optional[float] = ...) -> None: ...

class TierHealth(_message.Message):
    __slots__ = ("tier", "model", "up", "busy_s")
    TIER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    tier: str
    model: str
    up: bool
    busy_s: float
    def __init__(self, tier: _Optional[str] = ..., model: _Optional[str] = ..., up: _Optional[bool] = ..., busy_s: _Optional[float] = ...) -> None: ...

class QueueStats(_message.Message):
    __slots__ = ("waiting", "running", "max_queue", "job_items_pending")
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    JOB_ITEMS_PENDING_FIELD_NUMBER: _ClassVar[int]
    waiting: int
    running: int
    max_queue: int
    job_items_pending: int
    def __init__(self, waiting: _Optional[int] = ..., running: _Optional[int] = ..., max_queue: _Optional[int] = ..., job_items_pending: _Optional[int] = ...) -> None: ...

class RequestCounts(_message.Message):
    __slots__ = ("ok", "cancelled", "invalid", "rejected", "failed", "job_items_done")
    OK_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    JOB_ITEMS_DONE_FIELD_NUMBER: _ClassVar[int]
    ok: int
    cancelled: int
    invalid: int
    rejected: int
    failed: int
    job_items_done: int
    def __init__(self, ok: _Optional[int] = ..., cancelled: _Optional[int] = ..., invalid: _Optional[int] = ..., rejected: _Optional[int] = ..., failed: _Optional[int] = ..., job_items_done: _Optional[int] = ...) -> None: ...
